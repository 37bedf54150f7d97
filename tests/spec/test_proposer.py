"""The `Proposer` base holds the whole drafter protocol: every drafter class in `minillm.spec` is
one, the engine glue and the batch-1 loops read the protocol as attributes (no getattr / hasattr
on a proposer, read with `ast`), and each drafter's attributes say what the engine used to infer
(keyed: a draft model or a drafter with observe_chain; trees: one with propose_tree). An object
that drafts without subclassing `Proposer` is refused by name."""
import ast
import importlib
import inspect
import pkgutil
import types
from pathlib import Path

import pytest

import minillm.spec
from minillm import tiny_model
from minillm.spec.heads import EagleDrafter, MedusaHeads
from minillm.spec.loop import speculative_generate
from minillm.spec.methods import make_proposer
from minillm.spec.proposer import Proposer
from minillm.spec.proposers import DraftModelProposer

SPEC = Path(minillm.spec.__file__).parent
ENGINE = SPEC.parent / "engine"
DRAFTERS = {"NgramProposer", "DraftModelProposer", "MedusaProposer", "EagleProposer",
            "LookaheadProposer"}


def drafts(cls) -> bool:
    """Whether a class drafts: it has propose_tree, or a propose(contexts, k, ...)."""
    propose = vars(cls).get("propose")
    return "propose_tree" in vars(cls) or (
        propose is not None and list(inspect.signature(propose).parameters)[1:3] == ["contexts", "k"])


def drafter_classes() -> dict:
    """{name: class} of every class defined in minillm.spec that drafts (not SpecDecoder, whose
    propose takes the engine's sequences and asks its proposer)."""
    found = {}
    for info in pkgutil.iter_modules([str(SPEC)]):
        mod = importlib.import_module(f"minillm.spec.{info.name}")
        for name, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == mod.__name__ and cls is not Proposer and drafts(cls):
                found[name] = cls
    return found


def test_every_drafter_in_spec_is_a_proposer():
    classes = drafter_classes()
    assert DRAFTERS <= set(classes)                                   # the walk finds them
    assert [n for n, c in classes.items() if not issubclass(c, Proposer)] == []


def protocol_lookups(path: Path) -> list[str]:
    """getattr / hasattr calls whose object names a proposer or a drafter, as source text."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and node.args:
            obj = ast.unparse(node.args[0])
            if "propos" in obj or "drafter" in obj:
                hits.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return hits


def test_the_glue_reads_no_proposer_by_getattr(tmp_path):
    files = sorted(SPEC.glob("*.py")) + sorted(ENGINE.glob("*.py"))
    assert {"decoder.py", "methods.py", "loop.py", "tree_loop.py"} <= {p.name for p in files}
    assert [h for p in files for h in protocol_lookups(p)] == []
    bad = tmp_path / "glue.py"                                         # the check bites
    bad.write_text("def f(spec):\n    return getattr(spec.proposer, 'max_rank', None)\n")
    assert protocol_lookups(bad) == ["glue.py:2: getattr(spec.proposer, 'max_rank', None)"]


def test_keyed_is_what_the_engine_used_to_infer():
    """Keyed (given key=seq_id, shown each verify) was: the draft method, or observe_chain."""
    for name, cls in drafter_classes().items():
        own = {m for k in cls.__mro__ if k not in (Proposer, object) for m in vars(k)}
        assert cls.keyed == (cls is DraftModelProposer or "observe_chain" in own), name


def test_trained_drafters_read_their_window_and_plain_ones_one_row():
    model = tiny_model(seed=0)
    medusa = make_proposer("medusa", MedusaHeads(model.config, 3, seed=0), model, k=3)
    eagle = make_proposer("eagle", EagleDrafter(model.config, seed=0), model, k=3)
    assert (medusa.needs_features, medusa.feature_window, medusa.max_rank) == (True, 1, None)
    assert (eagle.needs_features, eagle.feature_window) == (True, eagle.window)
    assert make_proposer("lookahead", None).needs_features is False


def test_a_drafter_that_is_no_proposer_is_refused_by_name():
    model = tiny_model(seed=0)
    duck = types.SimpleNamespace(propose=print)
    with pytest.raises(TypeError, match="proposer must be a minillm.spec.proposer.Proposer"):
        speculative_generate(model, duck, [1, 2, 3], 4)
    with pytest.raises(TypeError, match="None or a Proposer, got SimpleNamespace"):
        make_proposer("lookahead", duck)
    with pytest.raises(NotImplementedError, match="drafts chains only"):
        DraftModelProposer(model).propose_tree([1, 2], None, None)
