"""Concurrent lookups/allocations/commits from several threads keep the accounting exact."""

import threading

import torch

from gr_plugin.cache import CacheRequest, HostTier, KVCacheManager, UserInFlightError

from .helpers import history_tokens, tiny_config


def test_four_threads_share_one_manager():
    cfg = tiny_config(num_pages=32, host_cache_bytes=32 * tiny_config().page_bytes)
    m = KVCacheManager(cfg, HostTier())
    errors: list[BaseException] = []
    done = {"steps": 0, "busy": 0, "full": 0}
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def worker(tid: int) -> None:
        g = torch.Generator().manual_seed(tid)
        barrier.wait()
        try:
            for i in range(80):
                # overlapping users on purpose: users 0..11 are shared by all threads
                users = torch.randperm(12, generator=g)[: 1 + i % 3].tolist()
                lengths = [int(torch.randint(1, 30, (1,), generator=g)) for _ in users]
                rows = torch.cat([history_tokens(u, n) for u, n in zip(users, lengths)])
                req = CacheRequest(users, lengths, rows)
                try:
                    plan = m.allocate(m.lookup(req))
                except UserInFlightError:
                    with lock:
                        done["busy"] += 1
                    continue
                if plan is None:
                    with lock:
                        done["full"] += 1
                    continue
                m.onboard_launch(plan).wait()
                n = plan.metadata.num_new_tokens
                for layer in range(cfg.num_layers):
                    m.append(layer, torch.zeros(n, 2, 4), torch.zeros(n, 2, 4), plan)
                (m.commit if i % 5 else m.abort)(plan)
                m.check()
                with lock:
                    done["steps"] += 1
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    m.offload_flush()
    m.check()
    stats = m.stats()
    assert done["steps"] > 100
    assert stats["commits"] + stats["aborts"] == done["steps"]
    assert stats["plans_in_flight"] == 0 and stats["copies_in_flight"] == 0
    assert stats["device_pages_free"] + sum(len(m.pages_of(u)) for u in range(12)) == cfg.num_pages
