"""SqueezeLLM codebooks and the lmpress-packed format that carries them."""

import json

import pytest
import torch
from safetensors.torch import load_file

from compressors.grid import GridSpec, round_to_nearest
from compressors.packed_int import unpack_int32
from compressors.squeezellm import squeezellm_quantize
from conftest import leftovers, refuse_in_process, run_cli
from pipelines.errors import LmpressError


def _problem(seed=0, rows=24, columns=128):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, columns, generator=g) * torch.linspace(0.1, 3, columns)  # uneven input scales
    w = torch.randn(rows, columns, generator=g) * 0.05
    return w, (x * x).mean(0)


def _weighted_error(w, q, sensitivity):
    return (((w - q) ** 2) * sensitivity).sum().item()


@pytest.mark.parametrize("bits,ratio", [(2, 0.5), (3, 0.75), (4, 0.99)])  # measured 0.44, 0.68, 0.98
def test_codebook_beats_the_uniform_grid_and_is_self_consistent(bits, ratio):
    """Weighted k-means: lower sensitivity-weighted error than per-channel RTN at the same bits;
    fp16-exact sorted tables; every weight on its nearest entry; deterministic."""
    w, sensitivity = _problem()
    q = squeezellm_quantize(w, sensitivity, bits)
    assert q.codebook.shape == (24, 1 << bits) and q.indices.dtype == torch.uint8 and q.indices.max() < (1 << bits)
    assert torch.equal(q.codebook, q.codebook.half().float()) and (q.codebook.diff(dim=1) >= 0).all()
    distance = (w.unsqueeze(-1) - q.codebook.unsqueeze(1)).abs()
    assert torch.allclose(distance.gather(2, q.indices.long().unsqueeze(-1)).squeeze(-1), distance.min(-1).values)
    rtn = round_to_nearest(w, GridSpec(bits, -1, symmetric=False)).dequantized()
    assert _weighted_error(w, q.dequantized(), sensitivity) < ratio * _weighted_error(w, rtn, sensitivity)
    again = squeezellm_quantize(w, sensitivity, bits)
    assert torch.equal(again.indices, q.indices) and torch.equal(again.codebook, q.codebook)


def test_sensitivity_moves_the_codebook_toward_sensitive_weights():
    w, sensitivity = _problem()
    flat = torch.ones_like(sensitivity)
    weighted, unweighted = squeezellm_quantize(w, sensitivity, 3), squeezellm_quantize(w, flat, 3)
    assert _weighted_error(w, weighted.dequantized(), sensitivity) < _weighted_error(w, unweighted.dequantized(), sensitivity)


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_error_feedback_onto_the_codebooks(bits):
    """squeezellm-gptq: the same tables, indices chosen by GPTQ: a lower output error
    tr(D H D^T) than nearest-entry rounding (measured 0.35 vs 0.59 at 3 bits)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 128, generator=g) @ torch.randn(128, 128, generator=g) * 0.1
    h, w = x.T @ x / x.shape[0], torch.randn(48, 128, generator=g) * 0.05
    loss = lambda q: torch.trace((w - q.dequantized()) @ h @ (w - q.dequantized()).T).item()  # noqa: E731
    plain, feedback = squeezellm_quantize(w, h.diagonal(), bits), squeezellm_quantize(w, h.diagonal(), bits, hessian=h)
    assert torch.equal(plain.codebook, feedback.codebook) and feedback.indices.dtype == torch.uint8
    assert loss(feedback) < 0.8 * loss(plain)


def test_constant_and_zero_rows():
    w = torch.zeros(3, 64)
    w[1] = 0.25
    q = squeezellm_quantize(w, torch.ones(64), 3)
    assert torch.equal(q.dequantized(), w.half().float())


def test_bad_codebook_bits():
    with pytest.raises(LmpressError, match="squeezellm takes bits 2, 3, 4"):
        squeezellm_quantize(torch.zeros(2, 8), torch.ones(8), 8)


@pytest.fixture
def tiny_calibration(tmp_path, tiny_folder):
    from pipelines.stages import CalibrateConfig, calibrate

    return calibrate(str(tiny_folder), tmp_path / "cal", CalibrateConfig(samples=4, seq_len=32))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_squeezellm_artifact_round_trips_and_serves(tmp_path, tiny_folder, tiny_calibration):
    """The lmpress-packed artifact: stock transformers refuses it (rather than loading random
    weights), lmpress's loader serves it with the logits of the in-memory codebook model, the
    stored indices and tables are exactly the chosen ones, and the kernels are validated."""
    from transformers import AutoModelForCausalLM

    from calibrate.stats import CalibrationData
    from compressors.kernels import PackedLinear
    from pipelines.models import load_model

    out = tmp_path / "sq"
    result = run_cli("quantize", "--model", tiny_folder, "--method", "squeezellm", "--bits", "3", "--calibration", tiny_calibration,
                     "--sequential", "false", "--skip", "lm_head,layers\\.3\\.mlp\\.down", "--out", out)
    assert result.returncode == 0, result.stderr
    settings = json.loads((out / "config.json").read_text())["quantization_config"]
    assert settings["quant_method"] == "lmpress" and settings["modules"]["model.layers.0.mlp.up_proj"] == {"bits": 3, "decode": "codebook", "sparse24": False}
    assert "model.layers.3.mlp.down_proj" not in settings["modules"]
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(out)

    reference = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    stats = CalibrationData(tiny_calibration)
    tensors = load_file(out / "model.safetensors")
    for name in settings["modules"]:
        index, local = int(name.split(".")[2]), name.split(".", 3)[3]
        module = reference.get_submodule(name)
        q = squeezellm_quantize(module.weight.data, stats.layer(index)[local].second_moment.diagonal(), 3)
        module.weight.data = q.dequantized()
        stored = unpack_int32(tensors[f"{name}.weight"], 3, module.in_features).long() + 4
        assert torch.equal(stored, q.indices.long()) and torch.equal(tensors[f"{name}.weight_codebook"].float(), q.codebook), name

    served = load_model(str(out)).model
    assert isinstance(served.model.layers[0].mlp.up_proj, PackedLinear) and type(served.model.layers[3].mlp.down_proj) is torch.nn.Linear
    ids = torch.randint(0, 49152, (2, 12))
    torch.testing.assert_close(_logits(served, ids), _logits(reference, ids), rtol=0, atol=1e-5)
    report = json.loads((out / "validation.json").read_text())
    assert report["max_rel_error"] < 1e-5 and {e["decode"] for e in report["layers"].values()} == {"codebook"}
    metrics = run_cli("evaluate", out, "--reference", tmp_path / "ref", "--base", tiny_folder, "--corpora", "pydoc-heldout",
                      "--windows", "2", "--seq-len", "32", "--out", tmp_path / "m.json")
    assert metrics.returncode == 0, metrics.stderr
    # 3-bit codes + an 8-entry fp16 table per 64-wide row = 5 bits; one linear of 28 left dense (32 bits)
    assert 5.5 < json.loads((tmp_path / "m.json").read_text())["bits_per_weight"] < 7


def test_squeezellm_bad_input(tmp_path, tiny_folder, tiny_calibration):
    out = tmp_path / "q"

    def error(*args):
        result = refuse_in_process("quantize", "--model", tiny_folder, "--out", out, "--method", "squeezellm", *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert not out.exists() and leftovers(out) == []
        return result.stderr.strip()

    assert "squeezellm takes bits 2, 3, 4 (got 8)" in error("--bits", "8", "--calibration", tiny_calibration)
    assert "needs --calibration" in error()
    assert "squeezellm quantizes to per-row codebooks, with no groups and no zero point: leave out --group-size (or pass --group-size -1; got 64)" \
        in error("--group-size", "64", "--calibration", tiny_calibration)
    assert "leave out --symmetric" in error("--symmetric", "false", "--calibration", tiny_calibration)
    plan = tmp_path / "plan.yaml"
    plan.write_text("'.*': {group_size: 32}\n")
    assert "squeezellm overrides set only bits" in error("--calibration", tiny_calibration, "--overrides", plan)
