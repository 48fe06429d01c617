"""Property: no recipe or cluster file gives a traceback; each is accepted or refused naming a key.

The inputs are the valid files we ship (recipes/, tests/data/recipes/, the golden cluster file)
mutated the way people and machines damage them: values of the wrong type, keys removed and added
(known ones in the wrong place, unknown ones, odd names), extreme numbers, odd and huge strings,
control characters, then text edits (characters inserted, lines cut or doubled, the file
truncated). In-process through ``load_recipe_text`` / ``read_cluster`` for thousands of cases, and a
few dozen through the real ``tilert-submit RECIPE --dry-run``. What is accepted must also plan,
render its batch script, and load again from ``J/recipe.yaml`` as the agents do.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from agent.job.paths import JobDir
from agent.problems import InputError, errors_of
from agent.recipe.cluster import ClusterConfig, load_cluster, read_cluster
from agent.recipe.loader import LoadedRecipe, load_recipe_text, resolved_yaml
from agent.recipe.model import Recipe
from agent.recipe.planner import make_plan
from submit.slurm.render import default_agent_command, render_sbatch
from tests.golden import GOLDEN_DIR, RECIPES
from tests.kit import clean_env
from tests.propkit import EXTREME_INTS, HUGE_TEXT, ODD_CHARS, ODD_TEXT, VALUES, examples

DATA = Path(__file__).parent / "data" / "recipes"
RECIPE_FILES = [
    RECIPES / "b200-nixl-glm5.yaml",
    RECIPES / "mi355x-mooncake-glm5.yaml",
    RECIPES / "local-demo.yaml",
    DATA / "b200-nixl-glm5.yaml",
    DATA / "mi355x-mooncake-glm5.yaml",
    # The recipes users hold: srtctl 2.x and the InferenceX fork's schema 1 (backend.type: tilert).
    DATA / "wild" / "inferencex-fixed-seq-len-1p1d-tp8-mtp.yaml",
    DATA / "wild" / "srtctl2-glm5-disagg.yaml",
]
CLUSTER_FILES = [
    DATA / "srtslurm.yaml",
    RECIPES / "srtslurm.example.yaml",
    GOLDEN_DIR / "mi355x.cluster.yaml",
]
TEST_CLUSTER = load_cluster(DATA / "srtslurm.yaml")
PROCESS_CLUSTER = ClusterConfig(launcher="process", network_interface="lo")
CLUSTERS = [None, TEST_CLUSTER, PROCESS_CLUSTER]


def _trees(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    return [(p, yaml.safe_load(p.read_text())) for p in paths]


BASE_RECIPES = _trees(RECIPE_FILES)
BASE_TEXT = RECIPE_FILES[0].read_text()
BASE_CLUSTERS = _trees(CLUSTER_FILES)


def _keys(tree: Any) -> Iterator[str]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield str(key)
            yield from _keys(value)
    elif isinstance(tree, list):
        for item in tree:
            yield from _keys(item)


def _model_keys(t: Any) -> Iterator[str]:
    import msgspec.inspect as mi

    if isinstance(t, mi.UnionType):
        for member in t.types:
            yield from _model_keys(member)
    elif isinstance(t, mi.StructType):
        for field in t.fields:
            yield field.encode_name
            yield from _model_keys(field.type)


# Keys that exist somewhere: put in the wrong place they test the "unknown key" paths.
KNOWN_KEYS = sorted(
    {k for _, t in BASE_RECIPES + BASE_CLUSTERS for k in _keys(t)}
    | set(_model_keys(msgspec.inspect.type_info(Recipe)))
    | set(_model_keys(msgspec.inspect.type_info(ClusterConfig)))
    | {"profiling", "sidecar", "backend", "<<", "prefill_nodes", "colocate"}
)
KEYS = st.one_of(st.sampled_from(KNOWN_KEYS), ODD_TEXT, EXTREME_INTS)


def _slots(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a mapping entry or a list item."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    if isinstance(tree, dict | list):
        for key, value in items:
            yield (*path, key)
            if isinstance(value, dict | list):
                yield from _slots(value, (*path, key))


def _parent(tree: Any, path: tuple[Any, ...]) -> Any:
    for part in path[:-1]:
        tree = tree[part]
    return tree


# Each edit is drawn with the same chance; a huge value is one of them.
OPS = ["replace", "replace", "delete", "add", "wrap", "stringify", "nest", "huge"]


@st.composite
def mutated_tree(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` after one to five structural edits."""
    tree = copy.deepcopy(base)
    for _ in range(draw(st.integers(min_value=1, max_value=5))):
        slots = list(_slots(tree))
        if not slots:
            tree = {str(draw(KEYS)): draw(VALUES)}
            continue
        path = draw(st.sampled_from(slots))
        parent, key = _parent(tree, path), path[-1]
        op = draw(st.sampled_from(OPS))
        if op == "replace":
            parent[key] = draw(VALUES)
        elif op == "huge":
            parent[key] = draw(HUGE_TEXT)
        elif op == "delete":
            del parent[key]
        elif op == "add":
            target = parent[key] if isinstance(parent[key], dict) else parent
            if isinstance(target, dict):
                target[draw(KEYS)] = draw(VALUES)
            else:
                target.append(draw(VALUES))
        elif op == "wrap":
            parent[key] = draw(st.sampled_from([[parent[key]], {"type": parent[key]}]))
        elif op == "stringify":
            parent[key] = str(parent[key])
        else:  # a known section where a value was
            donor = draw(st.sampled_from(BASE_RECIPES + BASE_CLUSTERS))[1]
            parent[key] = copy.deepcopy(donor[draw(st.sampled_from(sorted(donor)))])
    return tree


@st.composite
def text_edits(draw: st.DrawFn, text: str) -> str:
    """``text`` after zero to three edits of the text itself."""
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        if not text:
            break
        at = draw(st.integers(min_value=0, max_value=len(text)))
        op = draw(st.sampled_from(["insert", "cut", "truncate", "double-line", "indent"]))
        if op == "insert":
            text = text[:at] + draw(st.text(alphabet=ODD_CHARS, min_size=1, max_size=3)) + text[at:]
        elif op == "cut":
            text = text[:at] + text[at + draw(st.integers(min_value=1, max_value=40)) :]
        elif op == "truncate":
            text = text[:at]
        elif op == "double-line":
            start = text.rfind("\n", 0, at) + 1
            end = text.find("\n", at)
            line = text[start : end if end >= 0 else len(text)]
            text = text[:start] + line + "\n" + text[start:]
        else:
            start = text.rfind("\n", 0, at) + 1
            text = text[:start] + draw(st.sampled_from(["  ", "\t", " "])) + text[start:]
    return text


# libyaml's emitter when present: drawing the examples must not cost more than checking them.
DUMPER: Any = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def dump(tree: Any) -> str:
    return yaml.dump(tree, Dumper=DUMPER, sort_keys=False, allow_unicode=True, width=100)


@st.composite
def recipe_texts(draw: st.DrawFn) -> str:
    _, base = draw(st.sampled_from(BASE_RECIPES))
    tree = draw(st.one_of(st.just(base), mutated_tree(base)))
    return draw(text_edits(dump(tree)))


@st.composite
def cluster_texts(draw: st.DrawFn) -> str:
    _, base = draw(st.sampled_from(BASE_CLUSTERS))
    tree = draw(st.one_of(st.just(base), mutated_tree(base)))
    return draw(text_edits(dump(tree)))


def assert_reported(exc: InputError) -> None:
    """Every error names a key, or is the one whole-file error; the report is printable."""
    errors = errors_of(exc.problems)
    assert errors, "an InputError without an error"
    whole_file = [p for p in errors if not p.path]
    if whole_file:
        assert len(errors) == 1, f"a whole-file error among others: {errors}"
    for p in errors:
        assert p.message, p
        assert p.hint, p
    for line in str(exc).splitlines():
        assert line.isprintable(), repr(line)


def accepted(loaded: LoadedRecipe) -> None:
    """What the submitter accepts plans, renders, and loads again on the nodes."""
    plan = make_plan(loaded, mock=False)
    msgspec.json.encode(plan)
    render_sbatch(plan, JobDir(Path("/tmp/tilert-prop/J")), default_agent_command(loaded.cluster))
    again = load_recipe_text(
        resolved_yaml(loaded), source="J/recipe.yaml", base_dir=DATA, on_submit_host=False
    )
    assert make_plan(again, mock=False).role("decode").args == plan.role("decode").args


@examples(800)
@given(text=recipe_texts(), cluster=st.sampled_from(CLUSTERS))
def test_any_recipe_is_loaded_or_refused_naming_a_key(
    text: str, cluster: ClusterConfig | None
) -> None:
    try:
        loaded = load_recipe_text(text, source="prop.yaml", base_dir=DATA, cluster=cluster)
    except InputError as exc:
        assert_reported(exc)
        return
    try:
        accepted(loaded)
    except InputError as exc:  # what only the planner or the batch script can check
        assert_reported(exc)


@examples(150)
@given(
    text=recipe_texts(), sets=st.lists(st.tuples(st.sampled_from(KNOWN_KEYS), VALUES), max_size=3)
)
def test_any_set_flag_is_applied_or_refused(text: str, sets: list[tuple[str, Any]]) -> None:
    items = [
        f"roles.decode.{key}={yaml.safe_dump(value, default_flow_style=True).strip()}"
        for key, value in sets
    ]
    try:
        load_recipe_text(text, source="p.yaml", base_dir=DATA, overrides=items)
    except InputError as exc:
        assert_reported(exc)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the module: hypothesis runs many examples per test function."""
    return tmp_path_factory.mktemp("prop-input")


@examples(300)
@given(text=cluster_texts())
@example(text="gpus_per_node: 8\n? ''\n: null\n")  # found by this test: an empty key named nothing
def test_any_cluster_file_is_read_or_refused_naming_a_key(scratch: Path, text: str) -> None:
    path = scratch / "srtslurm.yaml"
    path.write_text(text)
    try:
        cluster, warnings = read_cluster(path)
    except InputError as exc:
        assert_reported(exc)
        return
    assert all(w.severity == "warning" for w in warnings)
    # A cluster file that reads is usable with a recipe.
    try:
        load_recipe_text(BASE_TEXT, source="b200.yaml", base_dir=DATA, cluster=cluster)
    except InputError as exc:
        assert_reported(exc)


# ---- through the real command -------------------------------------------------------------------


def tilert_submit(recipe: Path, cluster: Path, job: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "submit.cli", str(recipe), "--dry-run"),
            *("--cluster", str(cluster), "--job-dir", str(job)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )


def assert_cli_outcome(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode in (0, 2), done.stderr
    assert "Traceback" not in done.stderr
    for line in done.stderr.splitlines():
        assert line.isprintable(), repr(line)
    if done.returncode == 2:
        assert "error: " in done.stderr
    else:
        assert done.stdout.startswith("Job directory: ")


_RUNS = iter(range(10**9))


@pytest.mark.parametrize("what", ["recipe", "cluster"])
@examples(12)
@given(data=st.data())
def test_tilert_submit_dry_run_exits_0_or_2(what: str, scratch: Path, data: st.DataObject) -> None:
    run = scratch / f"run-{next(_RUNS)}"
    run.mkdir()
    recipe, cluster = run / "recipe.yaml", run / "srtslurm.yaml"
    if what == "recipe":
        recipe.write_text(data.draw(recipe_texts()))
        cluster.write_text((DATA / "srtslurm.yaml").read_text())
    else:
        recipe.write_text(BASE_TEXT)
        cluster.write_text(data.draw(cluster_texts()))
    assert_cli_outcome(tilert_submit(recipe, cluster, run / "J"))
