import os

import torch

# Triton kernels run on CPU through the interpreter when there is no GPU (CI). Must be set before
# any kernel is launched.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread in the test process (not in the processes it starts: spawned ranks take their
# share of the cores, benchmark subprocesses their default). The tests' tensors are tiny: a second
# thread only adds a barrier to every op, and when the other core is busy (another process, a
# background run, a subprocess of a test) that barrier waits for a time slice: an engine step of a
# tiny model took 0.24 s with two threads on a loaded 2-core box, 3 ms with one.
torch.set_num_threads(1)

import pytest  # noqa: E402

import autodeploy_mla  # noqa: E402,F401


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the slow GPU cases (tests/gpu_cases.py; benchmarks/gpu_checks.sh full)")


def _mark_slow_gpu_cases(config, items):
    """`slow` on the GPU cases tests/gpu_cases.py names; unless --slow is given (or the -m
    expression names `slow`), a slow GPU case is skipped, so `pytest -m gpu` fits one device call.
    Slow CPU tests are not affected."""
    import fnmatch

    from gpu_cases import SLOW

    run_slow = config.getoption("--slow") or "slow" in (config.option.markexpr or "")
    skip = pytest.mark.skip(reason="slow GPU case (tests/gpu_cases.py): run with --slow")
    for item in items:
        if "gpu" not in item.keywords:
            continue
        node = item.nodeid.split("tests/", 1)[-1]
        function = node.split("[", 1)[0]
        if function in SLOW or any(fnmatch.fnmatchcase(node, p.replace("[", "[[]")) for p in SLOW):  # [ ] literal
            item.add_marker(pytest.mark.slow)
            if not run_slow:
                item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With AUTODEPLOY_TEST_TIMES=PATH, each test phase's wall time is appended to PATH as it ends
    (`nodeid<TAB>phase<TAB>seconds<TAB>outcome`): a GPU run stopped by its device call's time limit
    never prints pytest's --durations table, and tests/gpu_cases.py's estimates are corrected from
    these lines (benchmarks/gpu_checks.sh sets it)."""
    path = os.environ.get("AUTODEPLOY_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.2f}\t{report.outcome}\n")


def _background_consumers_last(items):
    """The tests of modules with background runs (`start_background_runs`, tests/background_runs.py)
    go last, in their collection order (which is also the order their drivers run in): the other tests
    run meanwhile on the first core instead of waiting in a fixture for a run still in progress."""
    def consumer(item) -> bool:
        return hasattr(getattr(item, "module", None), "start_background_runs")

    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (consumer(item), order[id(item)]))


def pytest_collection_modifyitems(config, items):
    _mark_slow_gpu_cases(config, items)
    _background_consumers_last(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """A test module may define `start_background_runs(items)`, called here with its selected tests:
    multi-process runs those tests need start now, at low priority, and overlap the (mostly
    single-threaded) tests collected before them (test_tensor_parallel.py)."""
    if session.config.option.collectonly:
        return
    by_module: dict = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "start_background_runs"):
            by_module.setdefault(module, []).append(item)
    for module, items in by_module.items():
        module.start_background_runs(items)


@pytest.fixture(scope="session")
def optimized_family():
    """`optimized_family(family, overrides)`: `optimize(family, overrides=overrides)`, built once per
    test session. Several files build the same tiny family with the same overrides (the pipeline,
    fuse_gemms, fuse_moe and tensor-parallel tests), and export is most of a build's time on CPU.
    For tests that only read the model (generate, prefill_logits, report, graph, weights): a test
    that changes a model's config, runner or weights builds its own."""
    from autodeploy_mla import optimize

    built: dict = {}  # (family, overrides) -> model; lives as long as the session fixture

    def get(family: str, overrides):
        key = (family, tuple(overrides))
        if key not in built:
            built[key] = optimize(family, overrides=list(overrides))
        return built[key]

    return get


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if anything builds a model or runs the passes."""
    import autodeploy_mla.api as api
    import autodeploy_mla.cli.build_command as cli_build

    def boom(*a, **k):
        raise AssertionError("build work started before the bad input was refused")

    for mod, name in ((api, "build_eager_model"), (api, "build_skeleton"), (api, "run_pipeline"), (cli_build, "optimize")):
        monkeypatch.setattr(mod, name, boom)
