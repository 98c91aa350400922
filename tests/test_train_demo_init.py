"""scripts/train_demo.py's `train --init`: a run starts from an exported checkpoint's weights (the fine-tune of a
shipped demo). The weights it starts from are the checkpoint's exactly (bf16-rounded, the experts' mxfp4 values),
checked against the float weights the checkpoint was exported from; a checkpoint of another tokenizer, or one mlx-lm
cannot load, is refused with one line."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tqbench.demo import DEMO_SPECS, SHIPPED_DEMO
from tqbench.quant.mxfp4 import unpack_mxfp4
from tqbench.shards.writer import from_bf16, to_bf16

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # builds, exports and reloads the chat demo's 22 M-parameter model


@pytest.fixture(scope="module")
def td():
    spec = importlib.util.spec_from_file_location("train_demo_init", ROOT / "scripts" / "train_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.SPEC = DEMO_SPECS["chat"]  # what main() sets for --spec chat
    return mod


@pytest.fixture(scope="module")
def exported(td, tmp_path_factory):
    """A randomly initialised chat demo saved as training leaves it (fp32, experts bf16 + their mxfp4 bytes) and
    exported as a checkpoint; its work directory carries the shipped tokenizer."""
    work = tmp_path_factory.mktemp("work")
    (work / "tokenizer").mkdir()
    shutil.copy(SHIPPED_DEMO / "tiktoken.model", work / "tokenizer" / "tiktoken.model")
    model = td.build_model(7)
    for moe in td.moe_layers(model):  # a router bias that is not all zeros
        moe.e_score_correction_bias = mx.random.uniform(-0.1, 0.1, moe.e_score_correction_bias.shape)
    td.save_float(model, work, "bf16")
    td.export(work, work / "checkpoint", check=False)
    return work


def test_init_starts_from_the_checkpoints_exact_values(td, exported):
    float_params = {k: np.array(v.astype(mx.float32)) for k, v in td.load_float(exported).items()}
    packed = td.load_packed(exported)
    model = td.build_model(0)  # another seed: every value must come from the checkpoint
    n = td.load_init(model, exported / "checkpoint", exported)
    got = dict(tree_flatten(model.parameters()))
    assert n == len(got) == len(float_params)
    changed = 0
    for k, v in float_params.items():
        if ".switch_mlp." in k:
            want = unpack_mxfp4(*packed[k])  # the exact mxfp4 bytes export wrote, through our own unpacker
        elif k.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
            want = v  # kept in float32 by the checkpoint
        else:
            want = from_bf16(to_bf16(v))
        assert got[k].dtype == mx.float32, k
        np.testing.assert_array_equal(np.array(got[k]), want, err_msg=k)
        changed += not np.array_equal(want, v)
    assert changed > 100  # rounding really happened on most tensors: the comparison is not float against itself


def test_init_refuses_another_tokenizer(td, exported, tmp_path):
    (tmp_path / "tokenizer").mkdir()
    other = (exported / "tokenizer" / "tiktoken.model").read_bytes().replace(b"\n", b"\n\n", 1)
    (tmp_path / "tokenizer" / "tiktoken.model").write_bytes(other)
    with pytest.raises(SystemExit, match="tokenizer is not the one"):
        td.load_init(td.build_model(0), exported / "checkpoint", tmp_path)
    with pytest.raises(SystemExit, match="no tiktoken.model there"):
        td.load_init(td.build_model(0), tmp_path, tmp_path)
    broken = tmp_path / "broken"  # the right tokenizer, no config or weights
    broken.mkdir()
    shutil.copy(exported / "tokenizer" / "tiktoken.model", broken / "tiktoken.model")
    with pytest.raises(SystemExit, match="mlx-lm cannot load it"):
        td.load_init(td.build_model(0), broken, exported)


def test_export_weights_writes_that_folders_values_not_the_kept_ones(td, exported, tmp_path):
    # a run that kept an earlier step saves its last step in <work>/final (--save-final): export --weights final
    # ships those, with the work folder's tokenizer, and says so
    final = exported / "final"
    final.mkdir(exist_ok=True)
    other = td.build_model(11)
    td.save_float(other, final, "bf16")
    out = td.export(exported, tmp_path / "ckpt", check=True, weights=final)
    assert out["weights"] == "final" and out["check"]["tensors_exact"] == len(td.load_float(final))
    got = td.checkpoint_params(tmp_path / "ckpt")
    kept = td.checkpoint_params(exported / "checkpoint")
    name = next(k for k in sorted(got) if ".switch_mlp." not in k and got[k].ndim == 2)  # a bf16 matrix
    want = from_bf16(to_bf16(np.array(dict(tree_flatten(other.parameters()))[name].astype(mx.float32))))
    np.testing.assert_array_equal(np.array(got[name]), want)
    assert not np.array_equal(np.array(got[name]), np.array(kept[name]))


def test_export_refuses_weights_outside_the_work_folder(td, exported, tmp_path):
    # a folder that is not one of the run's saved weights: one line naming it, nothing written
    dest = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"--weights .*: not a folder of saved weights inside "):
        td.main(["export", "--spec", "chat", "--work", str(exported), "--weights", str(tmp_path), "--dest", str(dest)])
    assert not dest.exists()


def test_writing_the_same_runs_record_again_keeps_its_lineage_and_another_runs_drops_it(td, tmp_path):
    """results/demo-model.json's `lineage` is added by hand (the runs a fine-tune started from); exporting the same run
    again keeps it, a record of another run does not inherit it."""
    import json

    work, docs = tmp_path / "work", tmp_path / "demo-model.json"
    work.mkdir()
    record = {"spec": "chat", "curve": [[100, 2.5], [200, 2.25]]}
    lineage = [{"version": 6, "what": "trained from random weights"}]
    (work / "train.json").write_text(json.dumps(record))
    docs.write_text(json.dumps({"version": 8, "training": dict(record, lineage=lineage), "eval": {"x": 1}}))
    td.write_docs_training(work, {"path": "ckpt", "bytes": 5}, docs)
    doc = json.loads(docs.read_text())
    assert doc["training"] == dict(record, lineage=lineage)
    assert doc["checkpoint"] == {"path": "ckpt", "bytes": 5} and doc["eval"] == {"x": 1} and doc["version"] == 8
    other = dict(record, curve=[[100, 2.4]])
    (work / "train.json").write_text(json.dumps(other))
    td.write_docs_training(work, None, docs)
    assert json.loads(docs.read_text())["training"] == other
