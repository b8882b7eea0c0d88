"""What a run trained, outside it (detector/train/evaluate/export.py, pictures.py): an export that plain torch reads
into a fresh model with the trained predictions, read from the checkpoint's model rows alone, the evaluation's picture
in TensorBoard, and `detector predict`."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ROOT, child_env
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_helpers import tiny_cfg

from detector.cli import main as cli
from detector.data import build_loader
from detector.model import FaceDetector
from detector.train.checkpoints import dcp_io
from detector.train.checkpoints import files as checkpoint_files
from detector.train.checkpoints.state import CheckpointError, layout, read_checkpoint
from detector.train.evaluate.export import described, export, load_model
from detector.train.run.entry import run_training

RUN = ["device=cpu", "data.num_workers=0", "train.steps=4", "train.eval_every=2"]  # its checkpoint: at the end


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run with 2 head blocks (its checkpoint joins them): its folder."""
    tmp_path = tmp_path_factory.mktemp("trained")
    run_training(tiny_cfg(tmp_path, *RUN, "model.head_blocks=2"))
    return tmp_path / "default" / "padded"


def trained_predictions(run, images):
    """The predictions of the run's last checkpoint, read into its own 2-block model the project's way."""
    state = read_checkpoint(run)
    cfg = tiny_cfg(run, *RUN, "model.head_blocks=2")
    model = FaceDetector(cfg.data.image_size, cfg.data.max_boxes, list(cfg.model.channels), cfg.model.hidden, 2)
    for name, param in model.named_parameters():
        whole, first, _ = layout(model)[name]
        param.data.copy_(state["model"][whole][first : first + param.shape[0]])
    return model.eval()(images)


def test_an_export_loads_into_a_fresh_model_with_plain_torch_and_predicts_the_same(trained, tmp_path):
    path, _ = export(trained)
    assert path == trained / "export" / "model.pt"
    cfg = tiny_cfg(tmp_path, *RUN)
    images, _ = next(iter(build_loader(cfg.data, "padded", torch.device("cpu"), start=10**6)))
    torch.save(images, tmp_path / "images.pt")
    snippet = textwrap.dedent(
        f"""
        import torch; from detector.model import FaceDetector
        saved = torch.load({str(path)!r}, weights_only=True)
        model = FaceDetector(**saved["arguments"]); model.load_state_dict(saved["state_dict"])
        torch.save(model.eval()(torch.load({str(tmp_path / "images.pt")!r})), {str(tmp_path / "out.pt")!r})
        """
    )
    done = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with torch.no_grad():
        expected = trained_predictions(trained, images)
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=0, atol=0)


def test_each_evaluation_draws_its_predictions_into_tensorboard(trained):
    images = EventAccumulator(str(trained), size_guidance={"images": 0}).Reload().Images("eval/predictions")
    assert [event.step for event in images] == [2, 4] and 300 < images[0].width <= 350 and images[0].height > 300


def test_detector_predict_writes_the_picture_of_images_by_index_and_of_files(trained, tmp_path, capsys):
    out = tmp_path / "predictions.png"
    assert cli.main(["predict", str(trained), "3", "1000000", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000 and str(out) in capsys.readouterr().out
    import matplotlib.image

    picture = matplotlib.image.imread(out)
    assert picture.shape[0] > 200 and picture.shape[1] >= 300  # two images side by side
    png = tmp_path / "mine.png"
    matplotlib.image.imsave(png, torch.rand(40, 50).numpy(), cmap="gray")  # another size: resized to the model's
    assert cli.main(["predict", str(export(trained)[0]), "--images", str(png), "--faces", "2", "--out", str(out)]) == 0


def test_an_out_that_is_a_folder_gets_the_file_in_it_and_a_new_folder_is_made(trained, tmp_path, capsys):
    assert cli.main(["export", str(trained), "--out", str(tmp_path)]) == 0
    assert torch.load(tmp_path / "model.pt", weights_only=True)["state_dict"]
    assert cli.main(["predict", str(trained), "3", "--out", str(tmp_path)]) == 0
    assert cli.main(["predict", str(trained), "3", "--out", str(tmp_path / "new" / "p.png")]) == 0
    assert (tmp_path / "predictions.png").stat().st_size > 10_000 and (tmp_path / "new" / "p.png").is_file()


@pytest.fixture
def small_chunks(tmp_path, monkeypatch):
    """A tiny run checksummed in 4 KiB chunks, so that the model's rows and the optimizer's lie in chunks apart (at 64
    MiB a tiny checkpoint's file is one chunk): its folder. Its readers must see the same CHUNK."""
    monkeypatch.setattr(checkpoint_files, "CHUNK", 4096)
    run_training(tiny_cfg(tmp_path, *RUN))
    return tmp_path / "default" / "padded"


def save_folder(run):
    return run / json.loads((run / "checkpoint.json").read_text())["folder"]


def spans_of(run, part: str) -> dict:
    """Where the tensors of ``part`` ("model", "optimizer") lie in the run's checkpoint files."""
    metadata = dcp_io.Reader(save_folder(run)).read_metadata()
    keys = [key for key in metadata.state_dict_metadata if key.startswith(f"{part}/")]
    return checkpoint_files.tensor_spans(metadata, keys)


def test_export_reads_the_models_rows_alone_and_writes_what_the_whole_read_gives(small_chunks, monkeypatch, capsys):
    items, read_data = [], dcp_io.Reader.read_data

    def recorded(self, plan, planner):
        items.extend(item.storage_index.fqn for item in plan.items)
        return read_data(self, plan, planner)

    monkeypatch.setattr(dcp_io.Reader, "read_data", recorded)
    assert cli.main(["export", str(small_chunks)]) == 0
    part = read_checkpoint(small_chunks, only=("model",))
    assert set(items) == {f"model/{name}" for name in part["model"]}  # DCP read no optimizer/... item
    read = part["read"]  # the optimizer's state (exp_avg, exp_avg_sq: twice the model's bytes) left unread
    assert read.tensors <= read.read < read.total / 2, read
    assert described(read) in capsys.readouterr().out  # the command's line says it
    whole = read_checkpoint(small_chunks)
    assert whole["read"].read == whole["read"].total and whole["step"] == part["step"] == 4
    saved = torch.load(small_chunks / "export" / "model.pt", weights_only=True)
    with torch.device("meta"):
        where = layout(FaceDetector(**saved["arguments"]))
    assert saved["state_dict"].keys() == where.keys()
    for name, tensor in saved["state_dict"].items():
        whole_name, first, _ = where[name]
        expected = (
            whole["model"][whole_name][first : first + len(tensor)] if tensor.dim() else whole["model"][whole_name]
        )
        assert torch.equal(tensor, expected), name


def test_damage_in_the_optimizers_chunks_alone_leaves_the_export_as_it_was(small_chunks):
    """What export does not read, it does not check: a damaged chunk of the optimizer's state (a resume and the whole
    read refuse it) changes nothing of an export, which proves those bytes unread."""
    before = torch.load(export(small_chunks)[0], weights_only=True)["state_dict"]
    model, optimizer = spans_of(small_chunks, "model"), spans_of(small_chunks, "optimizer")
    name, chunk = next(
        (name, i)
        for name, ranges in optimizer.items()
        for i in checkpoint_files.chunks_of(ranges)
        if i not in checkpoint_files.chunks_of(model.get(name, []))
    )
    path = save_folder(small_chunks) / name
    raw = bytearray(path.read_bytes())
    raw[chunk * 4096 : (chunk + 1) * 4096] = b"\xff" * len(raw[chunk * 4096 : (chunk + 1) * 4096])
    path.write_bytes(bytes(raw))
    after = torch.load(export(small_chunks)[0], weights_only=True)["state_dict"]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(CheckpointError, match=f"{path} is corrupt"):
        read_checkpoint(small_chunks)


def damage(run, how: str) -> Path:
    """Damage the checkpoint of ``run`` as ``how`` says; the file damaged."""
    folder = save_folder(run)
    if how == "manifest garbage":
        (run / "checkpoint.json").write_text("not a manifest")
        return run / "checkpoint.json"
    if how == "metadata overwritten":
        path = folder / ".metadata"
        path.write_bytes(b"\xff" * 64 + path.read_bytes()[64:])
        return path
    name, ranges = next(iter(spans_of(run, "model").items()))
    path = folder / name
    if how == "part missing":
        path.unlink()
    elif how == "part truncated":
        path.write_bytes(path.read_bytes()[:-100])
    else:  # the model's rows overwritten
        raw = bytearray(path.read_bytes())
        offset, length = max(ranges, key=lambda r: r[1])
        raw[offset + length // 2 : offset + length // 2 + 64] = b"\xff" * 64
        path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("command", ["export", "predict"])
@pytest.mark.parametrize(
    "how, expected",
    [
        ("model's rows overwritten", "is corrupt (bytes 0.. do not match their checksum)"),
        ("part truncated", "is truncated or overwritten"),
        ("part missing", "is missing (named by"),
        ("metadata overwritten", "is corrupt (bytes 0.. do not match their checksum)"),
        ("manifest garbage", ": not JSON"),
    ],
)
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file(trained, tmp_path, capsys, command, how, expected):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    path = damage(run, how)
    argv = [command, str(run)] + (["3"] if command == "predict" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}") and expected in err and err.count("\n") == 1, err


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="the process's mappings are read from Linux's /proc")
def test_a_model_loaded_from_an_export_holds_the_files_pages_uncopied_and_the_runs_weights(trained, tmp_path):
    path, _ = export(trained, tmp_path)
    model, saved = load_model(path)
    maps = [line.split()[0] for line in Path("/proc/self/maps").read_text().splitlines() if str(path.resolve()) in line]
    mapped = [tuple(int(bound, 16) for bound in span.split("-")) for span in maps]
    weight = model.head[1].blocks[0].weight
    assert any(low <= weight.data_ptr() < high for low, high in mapped), (weight.data_ptr(), maps)
    assert saved["read"] == f"read the export's {checkpoint_files.human_bytes(path.stat().st_size)}, memory-mapped"
    from_run, _ = load_model(trained)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), from_run.state_dict().values(), strict=True)
    )


def test_predict_imports_matplotlib_only_to_draw():
    code = (
        "import sys, detector.train.evaluate.predict; "
        "print([m for m in ('matplotlib', 'tensorboard') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["export", "/nowhere/run"], "holds no checkpoint (checkpoint.json): train it first"),
        (["predict", "/nowhere/run", "3"], "/nowhere/run: no such run folder or export file"),
        (["predict", "{run}", "-1"], "sample indices are >= 0, got -1"),
        (["predict", "{run}/config.yaml", "3"], "config.yaml is not an export of detector (not the zip archive"),
        (["predict", "{run}", "--images", "/nowhere.png"], "/nowhere.png: cannot read it as an image"),
        (["predict", "{run}", "--faces", "0", "--images", "{run}/config.yaml"], "--faces 0: expected 1 to 16"),
        (["export", "{run}", "--out", "{run}/config.yaml/model.pt"], "config.yaml is a file, not a folder"),
        (["predict", "{run}", "3", "--out", "{run}/config.yaml/a/p.png"], "config.yaml is a file, not a folder"),
    ],
)
def test_bad_arguments_are_one_line(trained, capsys, argv, expected):
    assert cli.main([a.format(run=trained) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err


IMAGE_SIZES = """(() => {  // [natural width, width shown] of each image loaded, shadow roots included
  const out = [];
  const visit = (node) => {
    const loaded = node.tagName === 'IMG' && node.complete && node.naturalWidth > 0;
    if (loaded) out.push([node.naturalWidth, node.clientWidth]);
    if (node.shadowRoot) visit(node.shadowRoot);
    for (const child of node.children || []) visit(child);
  };
  visit(document.documentElement);
  return JSON.stringify(out);
})()"""


def test_the_evaluations_picture_shows_in_tensorboards_images_tab(trained, browser):
    """What a user opens: TensorBoard's Images tab over the run, the evaluation's held-out images with their true and
    predicted boxes, one picture a step it evaluated, shown at its own size in the tab's card (no scaling down that
    makes its titles unreadable) (TENSORBOARD_SCREENSHOTS=docs keeps the README's
    docs/tensorboard-eval.png)."""
    from browser_helpers import CLICK_ACTUAL_SIZE, keep, serve

    url, stop = serve(trained.parent.parent, ["default/padded"])
    try:
        text = browser.show(f"{url}/#images&tagFilter=eval", ["eval/predictions", "default/padded"], images=1)
        assert "No image data was found" not in text
        shown = json.loads(browser.evaluate(IMAGE_SIZES))
        assert shown and all(abs(w - natural) <= 2 for natural, w in shown), f"not shown at its size: {shown}"
        assert browser.evaluate(CLICK_ACTUAL_SIZE), "no 'Show actual image size' checkbox"
        shot = browser.screenshot(browser.profile.parent / "tensorboard-eval.png")
        assert shot.stat().st_size > 20_000
        keep(shot)
    finally:
        stop()
