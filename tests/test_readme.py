"""CI must run exactly the README's test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = next(line.strip() for line in readme.splitlines() if "pytest" in line and "pip install" in line)
    assert cmd in ci


# ----------------------------------------------------------------------------- facts the README states
def _flat(text: str) -> str:
    """The text with every run of whitespace as one space (sentences wrap across lines)."""
    return " ".join(text.split())


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_python_imports_resolve():
    """Every `from autodeploy_mla... import ...` line of the README's Python examples imports (on CPU,
    without the gpu extra: FlashInferPolicy's module needs no FlashInfer to import)."""
    import re

    lines = [ln.split("#")[0].strip() for block in re.findall(r"```python\n(.*?)```", _readme(), re.S)
             for ln in block.splitlines() if ln.startswith("from autodeploy_mla")]
    assert any("SamplingParams" in ln for ln in lines) and any("FlashInferPolicy" in ln for ln in lines), lines
    for ln in lines:
        exec(ln, {})


def test_readme_names_every_extra_and_what_bench_adds():
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = set(re.findall(r'\.\[(\w+)\]"', _readme()))
    assert named == set(extras), (named, set(extras))
    flat = _flat(_readme())
    for dep in extras["bench"]:
        name = re.split(r"[<>=\[]", dep)[0]
        assert f'pip install -e ".[bench]"` adds {name}' in flat


def test_readme_states_the_default_temperatures():
    """The server samples by default (OpenAI's temperature 1.0); `autodeploy build` is greedy."""
    import re

    from autodeploy_mla.cli import build_parser
    from autodeploy_mla.serving.protocol import ChatCompletionRequest, CompletionRequest

    flat = _flat(_readme())
    m = re.search(r"the server's default `temperature` is OpenAI's ([\d.]+)", flat)
    assert m, "the README must state the server's default temperature"
    for req in (CompletionRequest, ChatCompletionRequest):
        assert req.model_fields["temperature"].default == float(m.group(1))
    assert build_parser().parse_args(["build"]).temperature == 0.0
    assert "`autodeploy build` (like `om.generate`) is greedy by default: `--temperature 0`" in flat


def test_readme_cli_synopsis_flags_exist():
    """Every --flag of the README's `autodeploy build/serve/bench` synopsis is a flag of that command."""
    import re

    from autodeploy_mla.cli import build_parser

    subs = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices
    block = _readme().split("## CLI", 1)[1].split("\n\n", 2)[1]
    commands: dict[str, str] = {}
    cmd = None
    for ln in block.splitlines():
        if m := re.match(r"\s{4}autodeploy (\w+)", ln):
            cmd = m.group(1)
        if cmd is not None:
            commands[cmd] = commands.get(cmd, "") + ln
    assert {"build", "serve", "bench"} <= set(commands)
    for cmd, text in commands.items():
        known = {s for a in subs[cmd]._actions for s in a.option_strings}
        for flag in re.findall(r"--[a-z][a-z-]*", text):
            assert flag in known, f"README: autodeploy {cmd} {flag} is not a flag of that command"


def test_readme_bench_defaults_for_the_embedded_model():
    from autodeploy_mla.cli.bench_command import workload_lengths
    from autodeploy_mla.config import load_config

    lengths = workload_lengths(None, None, load_config("default").runtime.max_seq_len)
    flat = _flat(_readme())
    assert (f"(the embedded default's {load_config('default').runtime.max_seq_len}: prompts "
            f"{lengths.prompt[0]}:{lengths.prompt[1]}, {lengths.output[0]} output tokens)") in flat
