"""FlexKV-style tier configuration: YAML round trip, aliases, unknown keys and bad values rejected."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from gr_plugin.cache.tiers import TierConfig, load_tier_config, tier_config_to_yaml

FLEXKV_YAML = """\
cpu_cache_gb: 32
ssd_cache_gb: 1024
ssd_cache_dir: /data0/flexkv_ssd/;/data1/flexkv_ssd/
enable_3rd_remote: true
remote_cache_address: 10.0.0.7:6380
"""


def test_defaults_are_valid():
    cfg = TierConfig()
    assert cfg.ssd_o_direct == "auto" and cfg.write_policy == "write_through" and not cfg.ssd_enabled
    assert cfg.cpu_cache_bytes == 1 << 30


def test_flexkv_yaml_loads(tmp_path):
    path = tmp_path / "tiers.yaml"
    path.write_text(FLEXKV_YAML)
    cfg = load_tier_config(path)
    assert cfg.cpu_cache_gb == 32.0 and cfg.ssd_cache_bytes == 1024 << 30
    assert cfg.ssd_cache_dirs == ["/data0/flexkv_ssd/", "/data1/flexkv_ssd/"]
    assert cfg.enable_3rd_remote and cfg.remote_url == "redis://10.0.0.7:6380/0"
    assert load_tier_config(str(path)) == cfg


def test_yaml_round_trip(tmp_path):
    cfg = TierConfig(cpu_cache_gb=0.5, ssd_cache_gb=2, ssd_cache_dir=str(tmp_path), enable_3rd_remote=True,
                     remote_url="redis://cache:6379/3", ssd_num_threads=8, ssd_o_direct=False,
                     write_policy="on_evict", remote_write_through=False, fail_open=False, task_timeout_s=0.25,
                     remote_ttl_s=86400)
    path = tmp_path / "out.yaml"
    path.write_text(tier_config_to_yaml(cfg))
    assert load_tier_config(path) == cfg
    assert load_tier_config(OmegaConf.load(path)) == cfg  # a DictConfig works too
    assert load_tier_config(cfg.to_dict()) == cfg


@pytest.mark.parametrize("aliases, url", [
    ({"remote_cache_address": "redis-host:7000"}, "redis://redis-host:7000/0"),
    ({"remote_cache_address": "rediss://user:pw@h:1/2"}, "rediss://user:pw@h:1/2"),
    ({"redis_host": "10.1.2.3", "redis_port": 6390}, "redis://10.1.2.3:6390/0"),
    ({"redis_host": "h", "redis_db": 4}, "redis://h:6379/4"),
    ({"redis_host": "h", "redis_port": 1, "remote_url": "redis://h:1/0"}, "redis://h:1/0"),
])
def test_remote_address_aliases(aliases, url):
    assert load_tier_config({"enable_3rd_remote": True, **aliases}).remote_url == url


@pytest.mark.parametrize("aliases, bad", [
    ({"remote_cache_address": "h:1", "redis_host": "h"}, "not both"),
    ({"redis_port": 6379}, "need redis_host"),
    ({"remote_cache_address": "no-port"}, "no-port"),
    ({"redis_host": "h", "redis_port": 70000}, "70000"),
    ({"redis_host": "h", "remote_url": "redis://other:1/0"}, "disagrees"),
])
def test_bad_aliases(aliases, bad):
    with pytest.raises(ValueError, match=bad):
        load_tier_config(aliases)


def test_unknown_keys_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['ssd_cache_size'\]"):
        load_tier_config({"ssd_cache_size": 3})
    path = tmp_path / "typo.yaml"
    path.write_text("cpu_cache_gb: 1\nenable_3rd_remot: true\n")
    with pytest.raises(ValueError, match="enable_3rd_remot"):
        load_tier_config(path)


def test_unreadable_sources_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"missing\.yaml"):
        load_tier_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_tier_config(bad)
    with pytest.raises(ValueError, match="mapping"):
        load_tier_config(42)


@pytest.mark.parametrize("value, expected", [("AUTO", "auto"), ("true", True), ("off", False), (True, True)])
def test_o_direct_spellings(value, expected):
    assert TierConfig(ssd_o_direct=value).ssd_o_direct == expected


@pytest.mark.parametrize("field, value", [
    ("cpu_cache_gb", -1),
    ("cpu_cache_gb", "1GB"),
    ("ssd_cache_gb", float("nan")),
    ("ssd_cache_gb", True),
    ("enable_3rd_remote", "yes"),
    ("remote_url", "10.0.0.1:6379"),
    ("ssd_num_threads", 0),
    ("ssd_num_threads", 2.0),
    ("ssd_o_direct", "maybe"),
    ("write_policy", "write_back"),
    ("fail_open", 1),
    ("task_timeout_s", 0),
    ("remote_ttl_s", 0),
    ("remote_ttl_s", 1.5),
    ("remote_ttl_s", True),
])
def test_bad_values_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        TierConfig(**{field: value})


@pytest.mark.parametrize("url, error", [
    ("redis://h:99999/0", r"'redis://h:99999/0': the port must be a number in \[0, 65535\]"),
    ("redis://h:x/0", r"port must be"),
    ("redis://h:6379/abc", r"database .* must be a number"),  # (redis-py used database 0)
    ("redis://h:6379/1;x", r"database .* must be a number"),  # (the same)
    ("redis://user:s3cret@h:6379/0?db=two", r"'redis://\*\*\*@h:6379/0\?db=two': the database"),
    ("redis://:pa/ss@h:6379/0", r"'redis://\*\*\*@h:6379/0': the port"),  # (a '/' in the password: not shown)
])
def test_a_remote_url_with_a_bad_port_or_database_is_refused_before_connecting(url, error):
    with pytest.raises(ValueError, match=error) as refused:
        TierConfig(remote_url=url)
    assert "s3cret" not in str(refused.value) and "pa/ss" not in str(refused.value)
    for good in ("redis://h:6379/2", "redis://h", "rediss://:pw@h:1/", "redis://[::1]:6379/0", "unix:///tmp/r.sock",
                 "redis://h:6379/abc?db=2", "redis://h/%31"):  # (?db= beats the path; the path is %-decoded)
        assert TierConfig(remote_url=good).remote_url == good


def test_ssd_size_needs_a_directory():
    with pytest.raises(ValueError, match="ssd_cache_dir"):
        TierConfig(ssd_cache_gb=1.0)
    assert TierConfig(ssd_cache_gb=1.0, ssd_cache_dir="/tmp/x").ssd_enabled


def test_fields_are_flexkv_names_plus_ours():
    names = [f.name for f in dataclasses.fields(TierConfig)]
    assert names[:4] == ["cpu_cache_gb", "ssd_cache_gb", "ssd_cache_dir", "enable_3rd_remote"]


def test_redact_hides_url_credentials_everywhere():
    from gr_plugin.cache.tiers.flexkv_config import redact

    cfg = {"tiers": {"remote_url": "redis://user:s3cret@cache:6379/0", "n": 3}, "urls": ["rediss://:pw@h:1/2"],
           "plain": "redis://cache:6379/0"}
    out = redact(cfg)
    assert out == {"tiers": {"remote_url": "redis://***@cache:6379/0", "n": 3}, "urls": ["rediss://***@h:1/2"],
                   "plain": "redis://cache:6379/0"}
    assert "s3cret" not in repr(out) and cfg["tiers"]["remote_url"].endswith("s3cret@cache:6379/0")  # (a copy)
    with pytest.raises(ValueError, match=r"disagrees with its alias") as err:  # (the error shows neither password)
        load_tier_config({"remote_url": "redis://:s3cret@a:1/0", "remote_cache_address": "redis://:pw2@b:2/0"})
    assert "s3cret" not in str(err.value) and "pw2" not in str(err.value) and "redis://***@a:1/0" in str(err.value)


def test_a_ttl_redis_cannot_take_is_refused():
    """Redis refuses every SET whose expiry overflows its ms clock: such a TTL left the remote tier dead
    for the whole run, with warnings only."""
    from gr_plugin.cache.tiers.flexkv_config import MAX_TTL_S

    assert TierConfig(remote_ttl_s=MAX_TTL_S).remote_ttl_s == MAX_TTL_S
    with pytest.raises(ValueError, match=r"remote_ttl_s must be an int in \[1, 2147483647\] .*got 9{20}"):
        TierConfig(remote_ttl_s=99999999999999999999)


def test_a_url_address_with_a_separate_database_is_refused():
    """``remote_cache_address`` as a URL names its database in its path: a ``redis_db`` beside it was
    silently ignored."""
    with pytest.raises(ValueError, match=r"remote_cache_address='redis://\*\*\*@h:6380/1' is a URL .*redis_db=3"):
        load_tier_config({"remote_cache_address": "redis://u:pw@h:6380/1", "redis_db": 3})
    assert load_tier_config({"remote_cache_address": "redis://h:6380/1"}).remote_url == "redis://h:6380/1"
    assert load_tier_config({"remote_cache_address": "h:6380", "redis_db": 3}).remote_url == "redis://h:6380/3"
