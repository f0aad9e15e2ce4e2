"""`spy_launches`: see the launches of a Triton kernel a module holds, and still run them."""


def spy_launches(monkeypatch, module, name, record) -> None:
    """Replace ``module.<name>`` (a ``@triton.jit`` kernel) for the test: each launch calls ``record(grid,
    kwargs)`` first, then launches the real kernel with the same arguments."""
    real = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                record(grid, kwargs)
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, name, Spy())
