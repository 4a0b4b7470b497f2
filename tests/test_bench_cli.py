"""The bench command's registry, without running an experiment: every example script is a
registered experiment, every experiment's flags come from its ``Options`` with the same
defaults, and a name that is none of them is refused with the list."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from dask_kvstate.bench import registry
from dask_kvstate.bench.options import default, flag, metadata

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
CALL = re.compile(r'bench\.main\(\["([\w-]+)"')


def _example(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exits(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        registry.main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_calls_a_registered_experiment(path, capsys):
    source = path.read_text()
    names = CALL.findall(source)
    assert len(names) == 1, f"{path.name} must call bench.main([<experiment>, ...]) once"
    exp = registry.find(names[0])
    assert exp is not None and exp.name == names[0], f"{path.name} calls {names[0]!r}, which is not registered"
    module = _example(path)
    assert module.__doc__, f"{path.name} keeps its docstring"
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    assert f"{registry.PROG}" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(registry.EXPERIMENTS))
def test_every_experiment_has_a_help_listing_each_option(name, capsys):
    exp = registry.EXPERIMENTS[name]
    code, text = _exits([name, "--help"], capsys)
    assert code == 0
    options, run = exp.load()
    assert callable(run)
    for f in dataclasses.fields(options):
        if f.init and not metadata(options, f).get("positional"):
            assert flag(f.name) in text, f"{name} --help lacks {flag(f.name)}"
            assert metadata(options, f).get("help"), f"{name}: {f.name} has no help"


@pytest.mark.parametrize("name", list(registry.EXPERIMENTS))
def test_argparse_defaults_are_the_dataclass_defaults(name):
    exp = registry.EXPERIMENTS[name]
    options, _ = exp.load()
    parser = registry.parser(exp)
    for f in dataclasses.fields(options):
        if f.init:
            assert parser.get_default(f.name) == default(f), (name, f.name)
    # Parsed without flags, a command line stands for the defaults (the suite's names are its list).
    _, opts = registry.parse([name])
    if not exp.suite:
        assert opts == options()


def test_an_unknown_experiment_exits_2_naming_it_and_the_choices(capsys):
    code, text = _exits(["no-such-experiment"], capsys)
    assert code == 2
    assert "no-such-experiment" in text and "tree-of-thought" in text and "ttft" in text


def test_list_prints_every_experiment(capsys):
    assert registry.main(["--list"]) is None
    out = capsys.readouterr().out
    for exp in registry.EXPERIMENTS.values():
        assert exp.name in out and exp.summary in out


def test_the_aaflow_suite_takes_several_names_and_runs_the_five_by_default():
    exp, opts = registry.parse(["ttft", "scaling", "--quick"])
    assert exp.suite and opts.experiments == ["ttft", "scaling"] and opts.quick
    assert registry.parse([])[1].experiments == ["ttft", "scaling", "crossover", "memory", "throughput"]
    assert registry.parse(["--quick"])[1].experiments == registry.parse([])[1].experiments
    assert registry.parse(["1", "5"])[1].experiments == ["ttft", "throughput"]
    with pytest.raises(SystemExit) as e:
        registry.parse(["ttft", "kv-lifecycle"])  # any other experiment runs alone
    assert e.value.code == 2


def test_the_benchmarks_guide_lists_every_experiment():
    guide = (Path(__file__).parent.parent / "docs" / "guide" / "benchmarks.md").read_text()
    missing = [name for name in registry.EXPERIMENTS if f"| `{name}`" not in guide]
    assert not missing, f"docs/guide/benchmarks.md, 'The bench command', lacks {missing}"
