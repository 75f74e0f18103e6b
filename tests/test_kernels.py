"""Every kernel against its torch reference, in Triton's interpreter, on odd shapes too."""

import json
import re
import hashlib
import os

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from compressors.kernels import KERNELS, PackedLinear, select_kernel, self_check
from compressors.packed_int import PackedWeight, dequantize_reference, pack_sparse24, unpack_bitmask, dequantize_triton, matmul_reference, matmul_triton
from compressors.packed_int import random_packed_weight as random_packed
from compressors.packed_int import _in_code_order32
import triton  # noqa: E402  (after compressors, which selects Triton's backend)
import triton.language as tl
from conftest import dequantized_in_place, refuse_in_process, run_cli, tiny_model
from pipelines.errors import LmpressError

# The interpreter here; with TRITON_INTERPRET=0 on a CUDA machine the same tests run the
# compiled kernels (benchmarks/gpu_check.sh).
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


def packed(bits, rows, columns, group, kind="symmetric", seed=0):
    return random_packed(bits, rows, columns, group, kind, seed).to(DEVICE)


def assert_matches_reference(got, x, weight, context=None):
    """A kernel's output against the torch reference, within the rounding of x's dtype."""
    expected = matmul_reference(x, weight).float()
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[x.dtype]
    assert (got.float() - expected).abs().max() <= tolerance * max(1.0, expected.abs().max().item()), context


SHAPES = [  # bits, N, K, group, decode: K off the 64-column block, per-channel, one output row, 3-bit codes straddling words
    (4, 96, 160, 32, "symmetric"), (4, 1, 128, 64, "symmetric"), (8, 40, 100, 100, "symmetric"), (2, 64, 96, 32, "symmetric"),
    (4, 130, 64, 64, "symmetric"), (4, 24, 36, 36, "asymmetric"), (3, 72, 100, 50, "symmetric"), (3, 33, 96, 32, "asymmetric"), (8, 20, 64, 32, "asymmetric"),
    (3, 1, 200, None, "symmetric"),  # 3-bit per-channel: K ends inside a 3-word unit of 32 codes
    (3, 70, 100, None, "codebook"), (4, 1, 160, None, "codebook"), (2, 17, 64, None, "codebook"),
    # 2:4 sparse: K = 100 ends in half a mask byte; fp16 values, 4-bit grids over the kept half
    (16, 50, 100, None, "2:4 fp16"), (16, 1, 64, None, "2:4 fp16"), (4, 40, 160, 32, "2:4 symmetric"), (4, 33, 128, 64, "2:4 asymmetric"),
    (4, 7, 100, None, "2:4 symmetric"), (8, 1, 96, 32, "2:4 asymmetric"), (2, 9, 192, 64, "2:4 symmetric"), (4, 6, 80, 20, "2:4 symmetric"),
]


@pytest.mark.parametrize("bits,rows,columns,group,kind", SHAPES)
@pytest.mark.parametrize("batch,dtype", [(1, torch.float32), (1, torch.float16), (1, torch.bfloat16), (17, torch.float32), (17, torch.float16),
                                         (17, torch.bfloat16)])
def test_fused_matmul_matches_reference(bits, rows, columns, group, kind, batch, dtype):  # GEMV and GEMM (M off the block), every dtype
    if dtype == torch.bfloat16 and batch > 1 and DEVICE.type == "cpu":
        pytest.skip("Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584); compiled on a GPU only")
    weight = packed(bits, rows, columns, group, kind)
    x = torch.randn(batch, columns, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    assert_matches_reference(matmul_triton(x, weight), x, weight)


@pytest.mark.parametrize("bits,rows,columns,group,kind", SHAPES)
def test_dequantize_kernel_is_exact(bits, rows, columns, group, kind):
    weight = packed(bits, rows, columns, group, kind)
    assert torch.equal(dequantize_triton(weight, torch.float32), dequantize_reference(weight))


def test_references_decode_the_codes():
    """The torch references themselves, against codes and tables by hand."""
    codes = torch.tensor([[-4, 3, 0, -1, 2]], dtype=torch.int8)
    table = torch.arange(8, dtype=torch.float16).reshape(1, 8) / 4
    codebook = PackedWeight(pack_to_int32(codes, 3), None, 3, 5, codebook=table)
    assert dequantize_reference(codebook).tolist() == [[0.0, 1.75, 1.0, 0.75, 1.5]]  # index = code + 4
    grid = PackedWeight(pack_to_int32(codes, 3), torch.tensor([[0.5]]).half(), 3, 5, torch.tensor([[1]], dtype=torch.int8))
    assert dequantize_reference(grid).tolist() == [[-2.5, 1.0, -0.5, -1.0, 0.5]]  # (q - zero) * scale


def test_sparse24_layout_is_compressed_tensors_bitmask():
    """Kept values row by row in column order, the mask packed like numpy.packbits(little)."""
    import numpy

    from pipelines.errors import LmpressError

    g = torch.Generator().manual_seed(0)
    keep = (torch.rand(6, 5, 4, generator=g).argsort(dim=2) < 2).reshape(6, 20)
    w = torch.randn(6, 20, generator=g)
    values, bitmask = pack_sparse24(w, keep)
    assert numpy.array_equal(bitmask.numpy(), numpy.packbits(keep.numpy(), axis=-1, bitorder="little"))
    assert torch.equal(unpack_bitmask(bitmask, 20), keep) and torch.equal(values, w[keep].reshape(6, 10))
    sparse = PackedWeight(values.half(), None, 16, 20, bitmask=bitmask)
    assert torch.equal(dequantize_reference(sparse), (w * keep).half().float())
    with pytest.raises(LmpressError, match="keeps exactly 2 of every 4"):
        pack_sparse24(w, torch.ones_like(keep))


def test_self_check_and_selection():
    kernel = KERNELS[0]
    assert self_check(kernel, DEVICE)
    assert select_kernel(packed(4, 8, 64, 64), DEVICE) is kernel
    assert select_kernel(packed(3, 8, 64, None, "codebook"), DEVICE) is kernel


def test_self_check_rejects_a_kernel_that_computes_wrong():
    """The self-check runs `check` (the kernel untuned) against the reference: a kernel off by
    a little is never selected."""
    import dataclasses

    from compressors.kernels import _self_checked, interleave_setting

    kernel = KERNELS[0]
    broken = dataclasses.replace(kernel, name="off-by-a-little", check=lambda x, weight: kernel.check(x, weight) * 1.05)
    try:
        assert self_check(kernel, DEVICE) and not self_check(broken, DEVICE)
    finally:
        _self_checked.pop((broken.name, str(DEVICE), interleave_setting()), None)


def test_packed_linear_equals_the_dense_layer():
    weight = packed(4, 48, 128, 64)
    bias = torch.randn(48, device=DEVICE)
    layer = PackedLinear(weight, bias)
    x = torch.randn(2, 5, 128, device=DEVICE)
    expected = torch.nn.functional.linear(x, dequantize_reference(weight), bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


def test_packed_linear_keeps_its_launch_arguments_only_while_its_buffers_stay():
    """A layer on the kernel path keeps one PackedWeight (its launch arguments worked out once);
    loading another state or moving the buffers must drop it, or the kernel would read the old
    tensors."""
    first, second = packed(4, 16, 128, 64, seed=1).interleave(), packed(4, 16, 128, 64, seed=2)  # served interleaved, as CUDA does
    layer = PackedLinear(first, None)
    layer._kernels[torch.device(DEVICE)] = 0  # the kernel path, as on a GPU (the CPU otherwise serves a dense copy)
    x = torch.randn(3, 128, device=DEVICE)
    assert_matches_reference(layer(x), x, first)
    layer.load_state_dict(PackedLinear(second, None).state_dict())  # copied in place, in the artifact's layout
    layer._kernels[torch.device(DEVICE)] = 0
    assert_matches_reference(layer(x), x, second)
    layer.to(torch.float64)  # a new scale tensor
    layer(x)
    assert layer._served.scale is layer.scale


def test_quantized_artifact_carries_kernels_and_validation(tmp_path, tiny_folder, monkeypatch):
    """The quantize stage bundles the kernel source and a CPU validation report; served with
    PackedLinear layers the model gives the logits of its decompressed dense form."""
    from pipelines import serving
    from pipelines.models import load_model
    from pipelines.serving import load_for_serving

    out = tmp_path / "q"
    result = run_cli("quantize", "--model", tiny_folder, "--method", "rtn", "--bits", "4", "--group-size", "32", "--out", out)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "validation.json").read_text())
    assert report["gpu_validated"] is False and report["device"] == "cpu (Triton interpreter)"
    assert report["max_rel_error"] < 1e-5
    sources = report["kernels"]["triton-packed-matmul"]["sources"]
    assert set(sources) == {"kernels/packed_int.py", "kernels/packed_int_gluon.py"}
    assert all(hashlib.sha256((out / path).read_bytes()).hexdigest() == sha256 for path, sha256 in sources.items())
    assert serving.validation_failures(report, out) == []
    (out / "kernels" / "packed_int_gluon.py").write_text("# edited after validation\n")  # publishing checks what it would ship
    assert serving.validation_failures(report, out) == ["kernels/packed_int_gluon.py is missing or is not the triton-packed-matmul source that was validated"]
    elsewhere = serving.validate(out, tmp_path / "report.json")  # a report kept outside leaves the artifact as it is
    assert serving.validation_failures(elsewhere, out) == ["kernels/packed_int_gluon.py is missing or is not the triton-packed-matmul source that was validated"]
    serving.validate(out)  # validated again in place, it ships the kernels it checked
    assert serving.validation_failures(json.loads((out / "validation.json").read_text()), out) == []

    served, dense = load_for_serving(str(out)), load_model(str(out))
    assert isinstance(served.model.model.layers[0].mlp.down_proj, PackedLinear)
    ids = torch.randint(0, 49152, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(served.model(ids).logits, dense.model(ids).logits, rtol=1e-4, atol=1e-4)

    again = run_cli("validate", out, "--out", tmp_path / "v.json")
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "v.json").read_text())["layers"].keys() == report["layers"].keys()
    assert all(e["rows_checked"] == e["shape"][0] for e in report["layers"].values())  # all under 96 rows
    monkeypatch.setattr(serving, "INTERPRETED_ROWS", 40)  # the interpreter checks a layer's first rows
    fewer = serving.validate(out, tmp_path / "v40.json")
    assert fewer["layers"].keys() == report["layers"].keys() and fewer["passed"]
    assert sorted({(e["shape"][0], e["rows_checked"]) for e in fewer["layers"].values()}) == [(32, 32), (64, 40), (96, 40)]
    text = run_cli("generate", out, "Hello", "--max-new-tokens", "3")
    assert text.returncode == 0, text.stderr


@pytest.mark.parametrize("bits, rows, columns, group, kind, group_run", [
    (4, 48, 96, 32, "symmetric", 32), (4, 48, 576, 64, "asymmetric", 64), (4, 32, 576, None, "symmetric", 64),
    (4, 16, 512, 128, "asymmetric", 128), (4, 144, 512, 512, "asymmetric", 256),
    (4, 8, 64, 32, "symmetric", None), (4, 16, 80, 16, "symmetric", None), (3, 16, 64, 32, "symmetric", None), (4, 16, 64, None, "codebook", None),
])
def test_cpu_serves_bf16_through_torchs_int4_kernel_where_it_takes_the_weight(bits, rows, columns, group, kind, group_run):
    """On a CPU (where no Triton kernel serves, interpreter or not) a PackedLinear serves bf16 activations through torch's int4 kernel for the 4-bit grids it takes: rows a multiple
    of 16, groups of 32 or more (per channel and groups over 256 in 256-wide parts), zero points
    folded into the offsets; the rest from a bf16 dense copy. Either is the reference within bf16
    rounding; fp32 activations still get the exact fp32 dense copy. A layer repacked in 64-row
    blocks is the layer repacked whole."""
    from compressors import packed_int

    weight = random_packed(bits, rows, columns, group, kind)
    assert packed_int.cpu_int4_group(weight) == group_run
    linear = PackedLinear(weight, None)
    x = torch.randn(5, columns, generator=torch.Generator().manual_seed(0)).bfloat16()
    expected = matmul_reference(x.float(), weight)
    error = ((linear(x).float() - expected).norm() / expected.norm()).item()
    assert linear(x).dtype == torch.bfloat16 and error <= 5e-3, error
    if group_run:
        assert isinstance(linear._cpu_int4, packed_int.CpuInt4Weight) and linear._dense is None
        whole = -(-rows // 64) * 64
        assert torch.equal(packed_int.cpu_int4(weight, block_rows=64).packed, packed_int.cpu_int4(weight, block_rows=whole).packed)
        assert torch.equal(linear(torch.cat([x, x], dim=1)[:, :columns]), linear(x))  # a strided x as a contiguous one
    else:
        assert linear._cpu_int4 is False and linear._dense.dtype == torch.bfloat16
    assert torch.equal(linear(x.float()), matmul_reference(x.float(), weight))


def test_cpu_serves_a_quantized_model_in_bf16_from_its_packed_weights(tmp_path, tiny_folder, monkeypatch):
    """`lmpress generate`'s loader on a CPU: in bf16 every 4-bit linear
    of a quantized model runs torch's int4 kernel (no dense copy) and the logits are the bf16
    decompressed model's within bf16 rounding; `generate` serves in the dtype asked for, and
    `auto` resolves per device, to fp32 for speculative decoding (`serving_dtype`)."""
    from compressors import packed_int
    from pipelines.models import load_model
    from pipelines.serving import generate, load_for_serving, serving_dtype

    out = tmp_path / "q"
    result = run_cli("quantize", "--model", tiny_folder, "--method", "rtn", "--bits", "4", "--group-size", "32", "--out", out)
    assert result.returncode == 0, result.stderr
    served, dense = load_for_serving(str(out), "cpu", torch.bfloat16).model, load_model(str(out), torch.bfloat16).model
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, expected = served(ids).logits.float(), dense(ids).logits.float()
    linears = [module for module in served.modules() if isinstance(module, PackedLinear)]
    assert len(linears) == 28 and all(isinstance(m._cpu_int4, packed_int.CpuInt4Weight) and m._dense is None for m in linears)
    assert ((logits - expected).norm() / expected.norm()).item() <= 2e-2
    for dtype in ("bfloat16", "float32"):
        assert isinstance(generate(str(out), "Hello", 3, dtype=dtype), str)
    for native, expected_dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda native=native: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert serving_dtype("auto", "cpu") == expected_dtype and serving_dtype("auto", "cuda") == torch.float16
        assert serving_dtype("auto", "cpu", speculative=True) == serving_dtype("auto", "cuda", speculative=True) == torch.float32
    assert serving_dtype("float32", "cpu") == torch.float32
    with pytest.raises(LmpressError, match="--dtype must be auto, float32, bfloat16 or float16"):
        serving_dtype("int4", "cpu")


@pytest.mark.parametrize("kind", ["compressed-tensors", "compressed-tensors-asymmetric", "lmpress-packed"])
def test_serving_load_never_holds_a_dense_copy_of_a_packed_weight(tmp_path, tiny_folder, kind):
    """load_for_serving builds the model empty and fills it from the files, so no float tensor
    of a packed linear's shape is ever computed (transformers' loads decompress or initialize
    them: a whole dense model in host memory; the detector sees `dense_copy` make them), and it
    gives the logits of the base model with each packed weight dequantized in place (and, for
    symmetric compressed-tensors, of the decompressed load)."""
    from torch.utils import _pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipelines.models import load_model
    from pipelines.serving import dense_copy, load_for_serving, packed_weights
    from pipelines.stages import QuantizeConfig, quantize

    symmetric = kind == "compressed-tensors"
    if kind == "lmpress-packed":  # what the quantize stage writes for codebooks and the prune stage for 2:4; here an asymmetric grid
        import shutil

        from compressors.grid import GridSpec, round_to_nearest
        from compressors.lmpress_format import packed_weight, save_lmpress_packed

        model, out = load_model(str(tiny_folder)).model, tmp_path / "q"
        shutil.copytree(tiny_folder, out)
        save_lmpress_packed(model, {name: packed_weight(round_to_nearest(module.weight.data, GridSpec(4, 32, symmetric=False)))
                                    for name, module in model.named_modules() if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear)}, out)
    else:
        out = quantize(str(tiny_folder), None, tmp_path / "q", QuantizeConfig(method="rtn", bits=4, group_size=32, symmetric=symmetric))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == ("lmpress" if kind == "lmpress-packed" else "compressed-tensors")
    weights = packed_weights(out)
    assert {weight.kind for weight in weights.values()} == {"symmetric" if symmetric else "asymmetric"}
    packed = {(weight.rows, weight.columns) for weight in weights.values()}

    class DenseCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.overloadpacket is not torch.ops.aten.empty:  # nn.Linear's own, never written (no pages): accelerate moves it to meta at once
                self.shapes |= {tuple(t.shape) for t in _pytree.tree_leaves(result)
                                if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta and tuple(t.shape) in packed}
            return result

    with DenseCopies() as serving_load:
        served = load_for_serving(str(out)).model
    with DenseCopies() as copying:
        dense_copy(served)
    assert serving_load.shapes == set() and copying.shapes == packed
    assert not any(param.is_meta for param in served.parameters())
    assert (served.lm_head.weight is served.model.embed_tokens.weight) == served.config.tie_word_embeddings

    references = [dequantized_in_place(load_model(str(tiny_folder)).model, out)] + ([load_model(str(out)).model] if symmetric else [])
    ids = torch.randint(0, 49152, (1, 10))
    with torch.no_grad():
        for reference in references:
            torch.testing.assert_close(served(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_columns_grouped_out_of_order_are_refused_in_one_line(tmp_path, tiny_folder):
    """A compressed-tensors artifact whose weight_g_idx puts columns in groups out of order
    (llm-compressor's GPTQ with actorder="group") is refused by the serving loader and by
    `lmpress validate`, which read contiguous groups, and by the evaluation loader: transformers
    with compressed-tensors 0.20 ignores the tensor and gave the same logits as without it. A
    g_idx of contiguous groups is served."""
    from safetensors.torch import load_file, save_file

    from pipelines.models import load_model
    from pipelines.serving import load_for_serving
    from pipelines.stages import QuantizeConfig, quantize

    out = quantize(str(tiny_folder), None, tmp_path / "q", QuantizeConfig(method="rtn", bits=4, group_size=32))
    tensors, name = load_file(out / "model.safetensors"), "model.layers.0.mlp.down_proj"
    columns = int(tensors[f"{name}.weight_shape"][1])
    tensors[f"{name}.weight_g_idx"] = (torch.arange(columns) // 32).to(torch.int32)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert isinstance(load_for_serving(str(out)).model.get_submodule(name), PackedLinear)
    tensors[f"{name}.weight_g_idx"] = tensors[f"{name}.weight_g_idx"].roll(1)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for load in (load_for_serving, load_model):
        with pytest.raises(LmpressError, match=re.escape(f'{name} has its columns in groups out of order (weight_g_idx, GPTQ\'s actorder="group")')):
            load(str(out))
    result = refuse_in_process("validate", out, "--out", tmp_path / "v.json")
    assert result.returncode != 0 and "groups out of order" in result.stderr and len(result.stderr.splitlines()) == 1


def test_validation_fails_on_nan_and_damaged_artifacts_are_one_line(tmp_path, tiny_folder, monkeypatch):
    """A kernel that gives NaN fails validation (NaN compares false with any tolerance, and is
    no JSON), and `lmpress validate` exits 1 naming it; a failed report write never leaves an
    old report vouching for kernels it did not check. A packed artifact with a dense tensor
    missing, misshapen or of another kind (integers for floats), scales in other groups than its
    config says, or zero points not packed as compressed-tensors packs them, is one line
    (transformers would initialize the tensor at random; the kernels would decode other weights)."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    from compressors import kernels
    from pipelines import serving
    from pipelines.stages import QuantizeConfig, quantize

    out = quantize(str(tiny_folder), None, tmp_path / "q", QuantizeConfig(method="rtn", bits=4, group_size=32, symmetric=False))
    assert json.loads((out / "validation.json").read_text())["passed"]  # the stage's own report, which a failed write must not leave

    def wrong(x, weight):  # NaN for a lone token, 3x the product for a batch
        y = kernels.KERNELS[0].reference(x, weight)
        return torch.full_like(y, float("nan")) if x.shape[0] == 1 else 3 * y

    monkeypatch.setattr(kernels, "KERNELS", [dataclasses.replace(kernels.KERNELS[0], run=wrong), *kernels.KERNELS[1:]])
    report = serving.validate(out, tmp_path / "nan.json")
    assert not report["passed"] and report["max_rel_error"] is None
    json.loads((tmp_path / "nan.json").read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the report"))
    failures = serving.validation_failures(report)
    assert len(failures) == len(report["layers"]) and "gives NaN or inf" in failures[0]
    entry = next(iter(report["layers"].values()))
    entry["max_rel_error"]["1"] = 0.0  # what is left is the batches' error
    assert "off its torch reference by 2" in serving.validation_failures(report)[0]
    result = refuse_in_process("validate", out, "--out", tmp_path / "cli.json")
    assert result.returncode == 1 and result.stderr.startswith("error: kernel validation failed: ") and len(result.stderr.splitlines()) == 1

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serving, "write_json", disk_full)
    with pytest.raises(OSError):
        serving.validate(out)
    assert not (out / "validation.json").exists()  # not the old report beside kernels it did not check
    monkeypatch.undo()
    assert serving.validate(out)["passed"]

    tensors = load_file(out / "model.safetensors")
    for damage, message in (
        (lambda t: t.pop("model.norm.weight"), "lacks or misshapes model.norm.weight"),
        (lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:10].clone()}),
         "model.norm.weight (stored (10,) torch.float32, the model's (64,) torch.float32)"),
        (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}),
         "model.norm.weight (stored (64,) torch.int32, the model's (64,) torch.float32)"),
        (lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale": t["model.layers.0.mlp.up_proj.weight_scale"][:, :1].clone(),
                             "model.layers.0.mlp.up_proj.weight_zero_point": t["model.layers.0.mlp.up_proj.weight_zero_point"][:, :1].clone()}),
         "model.layers.0.mlp.up_proj.weight_scale holds 1 groups a row, not those of 64 inputs in groups of 32"),
        (lambda t: t.update({"model.layers.0.mlp.up_proj.weight_zero_point": torch.zeros(96, 2, dtype=torch.int8)}),  # unpacked
         "model.layers.0.mlp.up_proj.weight_zero_point is torch.int8 [96, 2], not int32 [12, 2]: the 96 x 2 4-bit zero points packed down"),
    ):
        damaged = dict(tensors)
        damage(damaged)
        save_file(damaged, out / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(LmpressError, match=re.escape(message)):
            serving.load_for_serving(str(out))


def test_packed_linear_answers_in_the_inputs_dtype_and_a_wrong_width_is_refused():
    weight = random_packed(4, 24, 64, 32)
    layer = PackedLinear(weight, torch.nn.Parameter(torch.randn(24)))  # an fp32 bias, as a checkpoint stores it
    x = torch.randn(3, 64, dtype=torch.float16)
    assert layer(x).dtype == torch.float16  # as nn.Linear's output: the bias does not promote it
    for width in (63, 65):  # the kernels would stop short of the weight's inputs or read past them
        with pytest.raises(LmpressError, match=f"x has {width} inputs; the weight takes 64"):
            matmul_triton(torch.randn(2, width), weight)


def test_validate_refuses_a_dense_model(tiny_folder):
    result = refuse_in_process("validate", tiny_folder)
    assert result.returncode == 2 and "is not a pack-quantized compressed-tensors or lmpress-packed artifact" in result.stderr


def test_quantize_validates_without_triton_interpret_in_the_environment(tmp_path, tiny_folder):
    """A user's shell has no TRITON_INTERPRET; on a machine without a GPU the stage must still
    run its kernels (in the interpreter) for the validation report."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "q"
    result = run_cli("quantize", "--model", tiny_folder, "--method", "rtn", "--group-size", "32", "--out", out, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "validation.json").read_text())["max_rel_error"] < 1e-5


def test_triton_backend_is_chosen_on_import_of_lmpress():
    """bitsandbytes and transformers import triton early, which fixes how Triton builds its
    language; importing lmpress first picks the interpreter on a machine without a GPU, and
    the other order fails with a clear error instead of a crash inside Triton."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    check = "import torch; from compressors.kernels import KERNELS, self_check; print(self_check(KERNELS[0], torch.device('cpu')))"
    first = subprocess.run([sys.executable, "-c", f"import pipelines.stages, transformers, bitsandbytes; {check}"], capture_output=True, text=True, env=env)
    assert first.returncode == 0 and first.stdout.strip() == "True", first.stderr
    late = subprocess.run([sys.executable, "-c", f"import transformers, bitsandbytes; {check}"], capture_output=True, text=True, env=env)
    assert late.returncode != 0 and "need its interpreter: set TRITON_INTERPRET=1" in late.stderr


def test_fast_grid_path_takes_whole_word_grids():
    """2/3/4/8-bit grids (2:4 ones too, but for 3 bits) and 2-4-bit codebooks go to the
    whole-unit kernels; the rest to the general tile kernels."""
    from compressors.packed_int import _takes_fast_grid

    assert _takes_fast_grid(packed(4, 8, 128, 32)) and _takes_fast_grid(packed(4, 8, 192, 96))
    assert _takes_fast_grid(packed(8, 8, 100, 100, "asymmetric"))  # one group per row
    assert not _takes_fast_grid(packed(4, 8, 200, 100))  # a word would straddle two groups
    assert _takes_fast_grid(packed(3, 8, 256, 128)) and _takes_fast_grid(packed(3, 8, 100, None))  # 3 words hold 32 codes
    assert not _takes_fast_grid(packed(3, 8, 96, 48))  # a 32-code unit would straddle two groups
    assert all(_takes_fast_grid(packed(bits, 8, 64, None, "codebook")) for bits in (2, 3, 4))
    assert not _takes_fast_grid(packed(8, 8, 64, None, "codebook"))
    assert _takes_fast_grid(packed(4, 8, 64, 32, "2:4 symmetric")) and _takes_fast_grid(packed(8, 8, 64, None, "2:4 asymmetric"))
    assert not _takes_fast_grid(packed(4, 8, 80, 20, "2:4 symmetric"))  # 10 stored codes a group: a word would straddle two
    assert not _takes_fast_grid(packed(16, 8, 64, None, "2:4 fp16"))


def _launch_shapes():
    """(dtype, batch, launch shape): each a test of its own, so xdist spreads their compiles on
    a GPU, where each runs in both activation dtypes (a compile of its own each). The
    interpreter runs a loop's loads in order whatever STAGES says, so there a GEMV launch that
    differs from an earlier one only in STAGES would repeat its test (it runs on a GPU); and as
    a launch shape decides the blocks, masks and split-K alike in either dtype, there the
    launches take the two dtypes in turn: every launch and both dtypes checked, in half the time."""
    from compressors.packed_int import GEMM_CONFIGS, GEMV_CONFIGS

    gemv, seen = [], set()
    for config in GEMV_CONFIGS:
        shape = (tuple((key, value) for key, value in config.kwargs.items() if key != "STAGES"), config.num_warps)
        if DEVICE.type == "cuda" or shape not in seen:
            gemv.append(config)
        seen.add(shape)
    cases, dtypes = [], [torch.float32, torch.float16]
    for i, (batch, config) in enumerate([(1, config) for config in gemv] + [(5, config) for config in GEMM_CONFIGS]):
        in_turn = dtypes if DEVICE.type == "cuda" else [dtypes[i % 2]]
        cases += [(dtype, batch, config) for dtype in in_turn]
    return cases


def _launch_id(value):
    """A launch shape's test id, in words `pytest -k` can select: `-k "every_tuned and pipelined"`
    runs the GEMV launches that copy blocks ahead (benchmarks/gpu_check.sh)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if not hasattr(value, "all_kwargs"):
        return None
    words = [f"{key}{setting}" for key, setting in value.kwargs.items()] + [f"num_warps{value.num_warps}", f"num_stages{value.num_stages}"]
    return "-".join(words + (["pipelined"] if value.kwargs.get("STAGES", 1) > 1 else []))


@pytest.mark.parametrize("dtype,batch,config", _launch_shapes(), ids=_launch_id)
def test_every_tuned_launch_shape_matches_reference(dtype, batch, config):
    """On a GPU the autotuner may pick any launch shape, split-K ones (partial sums added
    atomically into a zeroed y) included; the interpreter runs only the first, so each is run
    here by hand, on K that leaves the last slice short and N off every block."""
    from compressors import packed_int

    weights = [packed(4, 37, 1344, 32, "asymmetric"), packed(8, 20, 200, None), packed(2, 9, 512, 64), packed(4, 11, 416, None, "codebook"),
               packed(3, 13, 1312, 32, "asymmetric"), packed(3, 7, 100, None, "codebook"),  # 3 bits: 41 units; a last unit of 4 codes
               packed(4, 19, 1280, 64, "2:4 asymmetric"), packed(8, 5, 200, None, "2:4 symmetric"), packed(2, 9, 192, 64, "2:4 symmetric"),  # 2:4: 80, 25, 6 words
               packed(4, 21, 4096, 128), packed(4, 3, 2304, None),  # 4-bit symmetric: whole blocks (unmasked words), per-channel
               packed(4, 10, 576, 96),  # groups of 12 units: scales loaded per run of 4 (`group_units`), 3 runs a group
               packed(4, 6, 432, 48, "asymmetric"), packed(8, 5, 132, 12),  # runs of 2 and 1 units, several groups a block
               packed(4, 21, 4096, 128).interleave(), packed(3, 13, 1280, 128, "asymmetric").interleave()]  # the interleaved layout
    from triton.runtime.errors import OutOfResources

    checked = 0
    for weight in weights:
        x = torch.randn(batch, weight.columns, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
        y = torch.full((batch, weight.rows), float("nan"), dtype=dtype, device=DEVICE)  # split-K must zero it first
        try:
            got = packed_int._grid_matmul(x, weight, y, config)
        except OutOfResources:  # a GPU's shared memory cannot hold this tile for this kind: the tuner times it as infinite, never runs it
            continue
        assert_matches_reference(got, x, weight, (config, weight.kind, weight.bits))
        checked += 1
    assert checked, f"{config}: no weight fits this launch shape, so nothing was checked"


INTERLEAVABLE = [  # bits, N, K, group, decode: whole tiles of 4 units (4 bits: 32 columns; 3 bits: 128), each inside a group
    (4, 9, 256, 128, "symmetric"), (4, 5, 128, 32, "asymmetric"), (4, 3, 96, None, "symmetric"), (8, 7, 64, 32, "asymmetric"),
    (2, 6, 128, 64, "symmetric"), (3, 5, 256, 128, "symmetric"), (3, 4, 128, None, "codebook"), (2, 3, 192, None, "codebook"),
]


@pytest.mark.parametrize("bits,rows,columns,group,kind", INTERLEAVABLE)
@pytest.mark.parametrize("batch,dtype", [(1, torch.float32), (1, torch.float16), (5, torch.float32), (5, torch.float16)])
def test_interleaved_layout_decodes_and_serves_the_same_weight(bits, rows, columns, group, kind, batch, dtype):
    """The load-time repack moves codes, not values: the same codes and weights, and the
    whole-unit kernels read it (GEMV and GEMM) to the reference's result."""
    weight = packed(bits, rows, columns, group, kind)
    interleaved = weight.interleave()
    assert interleaved.interleaved and not torch.equal(interleaved.packed, weight.packed)
    assert torch.equal(interleaved.codes(), weight.codes())
    assert torch.equal(dequantize_reference(interleaved), dequantize_reference(weight))
    x = torch.randn(batch, columns, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    assert_matches_reference(matmul_triton(x, interleaved), x, weight)


@pytest.mark.parametrize("bits,rows,columns,group,kind", INTERLEAVABLE)
def test_repacking_a_block_of_rows_at_a_time_gives_the_whole_weights_layout(bits, rows, columns, group, kind, monkeypatch):
    """A repack runs REPACK_CODES codes' worth of rows at a time (bounded memory at serving
    time); two blocks, the last one short, give the bytes of the whole layer's repack."""
    from compressors import packed_int
    from compressors.packed_int import interleave_order, pack_codes, unit_codes

    weight = packed(bits, rows, columns, group, kind)
    whole = pack_codes(interleave_order(weight.codes(), unit_codes(bits)), bits)
    monkeypatch.setattr(packed_int, "REPACK_CODES", (rows // 2 + 1) * columns)
    interleaved = weight.interleave()
    assert torch.equal(interleaved.packed, whole)
    assert torch.equal(interleaved.unit_order().packed, weight.packed)


@pytest.mark.parametrize("per_unit", [4, 8, 16, 32])  # 8, 4, 2 and 3 bits
def test_interleaved_units_hold_a_tensor_core_threads_columns(per_unit):
    """In a tile of 4 units, unit q holds the columns 8 p + 2 q + b that thread q of a 16-bit
    tensor-core fragment reads, as code p + b * per_unit / 2; and the inverse restores column order."""
    from compressors.packed_int import interleave_order

    columns = torch.arange(8 * per_unit).reshape(1, -1)  # two tiles
    stored = interleave_order(columns, per_unit).reshape(2, 4, per_unit)
    half = per_unit // 2
    for tile in range(2):
        for q in range(4):
            for code in range(per_unit):
                p, b = code % half, code // half
                assert stored[tile, q, code] == tile * 4 * per_unit + 8 * p + 2 * q + b
    assert torch.equal(interleave_order(stored.reshape(1, -1), per_unit, inverse=True), columns)


def test_ptx_decodes_compute_what_the_interpreter_runs():
    """The 3-, 4- and 8-bit decodes' inline PTX, which only a GPU runs, emulated instruction by
    instruction (benchmarks/ptx_emulator.py) on random words against the Triton arithmetic the
    interpreter runs in its place: the GEMM's fp16 weights (`_fp16_tile`) to the bit, symmetric
    and with zero points, the 3-bit GEMV's code - 4 (`_centered_dot3`), and the 4-bit GEMV's sum
    of (code - 8) x (`_centered_dot4`) within fp32 rounding."""
    import numpy as np
    from benchmarks.ptx_emulator import run
    from compressors import packed_int

    rng = np.random.default_rng(0)
    decodes = {3: (packed_int._DECODE3_PTX.value, packed_int._DECODE3_ZERO_PTX.value),
               4: (packed_int._DECODE4_PTX.value, packed_int._DECODE4_ZERO_PTX.value),
               8: (packed_int._DECODE8_PTX.value, packed_int._DECODE8_ZERO_PTX.value)}
    for _ in range(200):
        unit = [int(w) for w in rng.integers(0, 1 << 32, size=3)]  # 3 bits: a unit is 3 words, codes 10 and 21 straddle
        word, run_bits = unit[0], unit[0] | unit[1] << 32 | unit[2] << 64
        scale = float(np.float16(rng.uniform(-0.2, 0.2)))
        for bits, (symmetric, asymmetric) in decodes.items():
            n, middle = 32 // bits if bits != 3 else 32, 1 << (bits - 1)
            codes = [(run_bits >> (bits * j)) & ((1 << bits) - 1) for j in range(n)]
            zero = int(rng.integers(-middle, middle))
            words = unit if bits == 3 else [word]
            for asm, offset in [(symmetric, middle), (asymmetric, middle + zero)]:
                got = run(asm, "=h," * n + "h,h," + ",".join("r" * len(words)), [scale, float(offset - middle), *words])
                expected = [np.float16(np.float16(c - offset) * np.float16(scale)) for c in codes]
                assert np.array(got, dtype=np.float16).view(np.uint16).tolist() == np.array(expected).view(np.uint16).tolist(), (bits, hex(word))
        centered = run(packed_int._CENTERED3_PTX.value, "=h," * 32 + "h,h,r,r,r", [0.0, 0.0, *unit])
        assert centered == [float(((run_bits >> (3 * j)) & 7) - 4) for j in range(32)], [hex(w) for w in unit]  # the 3-bit GEMV's
        codes = [(word >> (4 * j)) & 15 for j in range(8)]
        x = rng.standard_normal(8).astype(np.float32)
        (dot,) = run(packed_int._DOT4_PTX.value, "=f,r" + ",f" * 8, [word, *(float(v) for v in x)])
        terms = [(c - 8) * float(v) for c, v in zip(codes, x)]
        assert abs(dot - sum(terms)) <= 1e-5 * max(1.0, sum(abs(t) for t in terms))


def test_gluon_gemv_ptx_computes_the_dot_without_overflow():
    """The Gluon GEMV's half2 PTX (compressors/packed_int_gluon.py), emulated: x
    pairs regrouped by prmt to (x_j, x_j+4), a word decoded to (code - 8) / 32 and dotted with
    them in half2; and the pairs variant (DOT8_HALF2), two words to (code - 8) / 64 in one half2
    sum. Each stays within fp16 rounding of the exact sum, and finite at |x| = 65504, the largest
    fp16. (Its fp32 variant runs the served `_DOT4_PTX`, tested above.) And the relation
    its interleaved x addressing (`_x_pairs`) is built on, checked against `interleave_order`."""
    import numpy as np
    from benchmarks.ptx_emulator import _pack, run
    from compressors import packed_int
    from compressors import packed_int_gluon as gemv_gluon

    rng = np.random.default_rng(0)
    for trial in range(300):
        word = int(rng.integers(0, 1 << 32))
        x = np.float16(rng.choice([1e-3, 1.0, 100.0, 8000.0])) * rng.standard_normal(8).astype(np.float16)
        if trial == 0:
            word, x = 0x00000000, np.full(8, 65504, dtype=np.float16)  # every code 0: (0 - 8) / 32 x 65504, four times a half
        pairs = [_pack(float(x[2 * i]), float(x[2 * i + 1])) for i in range(4)]  # x as int32: (x_2i, x_2i+1)
        lo, hi = gemv_gluon.PAIR_LO.value, gemv_gluon.PAIR_HI.value
        q = [run(selector, "=r,r,r", [pairs[a], pairs[b]])[0] for a, b in ((0, 2), (1, 3)) for selector in (lo, hi)]
        terms = [(((word >> (4 * j)) & 15) - 8) / 32 * float(x[j]) for j in range(8)]
        (half2,) = run(gemv_gluon.DOT4_HALF2.value, "=f,r,r,r,r,r", [word, *q])
        size = sum(abs(t) for t in terms)
        assert np.isfinite(half2) and abs(half2 - sum(terms)) <= 2e-3 * size, (hex(word), x, half2, sum(terms))
        # HALF2=2: this word and its bit-reversed partner (another word of codes) with x reversed, in one
        # half2 sum of 16 products: (code - 8) / 64 keeps each half within max|x|, and y's 64 is exact
        partner, x2 = int(f"{word:032b}"[::-1], 2), x[::-1].copy()
        pairs2 = [_pack(float(x2[2 * i]), float(x2[2 * i + 1])) for i in range(4)]
        q2 = [run(selector, "=r,r,r", [pairs2[a], pairs2[b]])[0] for a, b in ((0, 2), (1, 3)) for selector in (lo, hi)]
        terms2 = terms + [(((partner >> (4 * j)) & 15) - 8) / 32 * float(x2[j]) for j in range(8)]
        (pair,) = run(gemv_gluon.DOT8_HALF2.value, "=f,r,r,r,r,r,r,r,r,r,r", [word, partner, *q, *q2])
        size2 = sum(abs(t) for t in terms2)
        assert np.isfinite(pair) and abs(2 * pair - sum(terms2)) <= 2e-3 * size2, (hex(word), hex(partner), x, pair, sum(terms2))
    # its interleaved layout's x: the decode's pair (code p, code p + 4) of unit u is the int32 x pair
    # 16 (u // 4) + 4 p + u % 4, columns (8 p + 2 (u % 4), + 1) of the unit's tile (`_x_pairs`)
    stored = packed_int.interleave_order(torch.arange(64).reshape(1, 64), per_unit=8)[0]  # stored position 8 u + code -> column
    for unit in range(8):
        for p in range(4):
            pair = 16 * (unit // 4) + 4 * p + unit % 4
            assert (stored[8 * unit + p].item(), stored[8 * unit + p + 4].item()) == (2 * pair, 2 * pair + 1)


# a block of 64 threads, each summing `n` floats of x from its own run; each warp's sum, by
# butterfly shuffles, stored by its lane 0 to out[warp]
_SUM_PTX = """
.visible .entry warp_sums(.param .u64 warp_sums_param_0, .param .u64 warp_sums_param_1, .param .u32 warp_sums_param_2)
.reqntid 64
{
    .reg .pred %p<3>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<6>;
    ld.param.b64 %rd1, [warp_sums_param_0];
    ld.param.b64 %rd2, [warp_sums_param_1];
    ld.param.b32 %r1, [warp_sums_param_2];
    mov.u32 %r2, %tid.x;
    mov.u32 %r3, %ctaid.x;
    mad.lo.s32 %r4, %r3, 64, %r2;
    mul.lo.s32 %r5, %r4, %r1;
    mul.wide.s32 %rd3, %r5, 4;
    add.s64 %rd4, %rd1, %rd3;
    mov.b32 %r6, 0f00000000;
    mov.b32 %r7, 0;
$L__loop:
    ld.global.b32 %r8, [%rd4 + 0];
    add.f32 %r6, %r6, %r8;
    add.s64 %rd4, %rd4, 4;
    add.s32 %r7, %r7, 1;
    setp.lt.s32 %p1, %r7, %r1;
    @%p1 bra $L__loop;
    shfl.sync.bfly.b32 %r9, %r6, 16, 31, -1;
    add.f32 %r6, %r6, %r9;
    shfl.sync.bfly.b32 %r9, %r6, 8, 31, -1;
    add.f32 %r6, %r6, %r9;
    shfl.sync.bfly.b32 %r9, %r6, 4, 31, -1;
    add.f32 %r6, %r6, %r9;
    shfl.sync.bfly.b32 %r9, %r6, 2, 31, -1;
    add.f32 %r6, %r6, %r9;
    shfl.sync.bfly.b32 %r9, %r6, 1, 31, -1;
    add.f32 %r6, %r6, %r9;
    and.b32 %r10, %r2, 31;
    setp.eq.s32 %p2, %r10, 0;
    shr.u32 %r11, %r4, 5;
    mul.wide.u32 %rd5, %r11, 4;
    add.s64 %rd5, %rd2, %rd5;
    @%p2 st.global.b32 [ %rd5 + 0 ], { %r6 };
    ret;
}
"""


def test_ptx_emulator_runs_a_kernel_and_faults_where_a_gpu_would():
    """benchmarks/ptx_emulator.py, which runs the compiled kernels on the CPU (the Hopper compile
    check above; benchmarks/gemv_gluon.py --emulate), on a hand-written kernel: a loop, warp
    shuffles, a predicated store, two blocks, and what it reads counted (--traffic). A read past
    the data or a misaligned one raises, as it would fault on a GPU; so does a branch its
    threads take apart, which lockstep cannot run."""
    import numpy as np
    from benchmarks.ptx_emulator import launch

    x = np.random.default_rng(0).standard_normal(2 * 64 * 3).astype(np.float32)
    out = np.zeros(4, np.float32)
    counted = {}
    launch(_SUM_PTX, (2,), [x, out, 3], traffic=counted)
    np.testing.assert_allclose(out, x.reshape(4, 96).sum(axis=1), rtol=1e-5)
    # each thread reads its 3 floats one at a time: 12 bytes apart across a warp, so each load
    # instruction touches 3x the 32-byte sectors it needs (and 3 128-byte lines, 384 bytes, where 1
    # would hold what it reads); every byte of x is read once
    assert counted == {0: {"requested": x.nbytes, "sectors": 3 * x.nbytes // 32, "lines": 3 * x.nbytes // 128, "distinct": x.nbytes}}
    with pytest.raises(MemoryError, match="outside the arrays"):
        launch(_SUM_PTX, (2,), [x[:300].copy(), out, 3])
    with pytest.raises(MemoryError, match="misaligned"):
        launch(_SUM_PTX.replace("add.s64 %rd4, %rd1, %rd3;", "add.s64 %rd4, %rd1, %rd3;\n    add.s64 %rd4, %rd4, 2;"), (2,), [x, out, 3])
    with pytest.raises(NotImplementedError, match="divergent"):
        launch(_SUM_PTX.replace("setp.lt.s32 %p1, %r7, %r1;", "setp.lt.s32 %p1, %r7, %r2;"), (2,), [x, out, 3])


def _warp_kernel(name: str, body: str, shared: bool = False) -> str:
    """A hand-written kernel of one warp taking two pointers (in %rd1, %rd2; its thread in %r1)."""
    return (".extern .shared .align 16 .b8 global_smem[];\n" if shared else "") + f"""
.visible .entry {name}(.param .u64 {name}_param_0, .param .u64 {name}_param_1)
.reqntid 32
{{
    .reg .b32 %r<8>;
    .reg .b64 %rd<6>;
    ld.param.b64 %rd1, [{name}_param_0];
    ld.param.b64 %rd2, [{name}_param_1];
    mov.u32 %r1, %tid.x;{body}
    ret;
}}
"""


# each of 32 threads reads x[lane] and takes the value of lane 5 lane % 32 (a lane per thread,
# as Gluon's reductions gather their results), stored to out[lane]
_GATHER_PTX = _warp_kernel("gather", """
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.b32 %r2, [%rd4 + 0];
    mul.lo.s32 %r3, %r1, 5;
    and.b32 %r3, %r3, 31;
    shfl.sync.idx.b32 %r4, %r2, %r3, 31, -1;
    add.s64 %rd4, %rd2, %rd3;
    st.global.b32 [%rd4 + 0], %r4;""")


def test_ptx_emulator_shuffles_from_the_lane_each_thread_names():
    """shfl.sync.idx with a lane that differs across threads (the emulator once took thread 0's
    lane for all, which made every row of a Gluon reduction's result the first row's)."""
    import numpy as np
    from benchmarks.ptx_emulator import launch

    x = np.arange(32, dtype=np.float32) + 0.5
    out = np.zeros(32, np.float32)
    launch(_GATHER_PTX, (1,), [x, out])
    np.testing.assert_array_equal(out, x[np.arange(32) * 5 % 32])


def _gemv_gluon_rows(tmp_path, mode: str, launches: str, written: str, *options: str) -> list[dict]:
    """benchmarks/gemv_gluon.py MODE (--emulate or --traffic) on those LAUNCHES, in its own process
    (it compiles for sm_90, which TRITON_INTERPRET=1 here would not): the rows it wrote."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gemv_gluon.py")
    result = subprocess.run([sys.executable, script, mode, "--launches", launches, "--out", str(tmp_path), *options], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads((tmp_path / written).read_text())


def test_gluon_gemv_computes_as_compiled_for_hopper(tmp_path):
    """The Gluon GEMV (compressors/packed_int_gluon.py), which no interpreter runs, compiled for
    sm_90 and its PTX run on the CPU (benchmarks/gemv_gluon.py --emulate), in groups of 128 in both
    layouts and per channel, at launches covering each of its code paths (half2 and fp32
    arithmetic; 1, 2 and 4 rows and 4 or 8 words a thread; x by 4-byte loads with warps split
    along K, whose sum crosses warps in shared memory; prefetch), every launch serving may pick
    among them: y within fp16 rounding of the reference. (Without --launches it runs all 32.)"""
    from compressors.packed_int_gluon import LAUNCHES, SERVED

    others = [LAUNCHES.index(launch) for launch in LAUNCHES if launch not in SERVED]
    chosen = ",".join(str(i) for i in [LAUNCHES.index(launch) for launch in SERVED] + [others[0], others[-1]] + [i for i in others if LAUNCHES[i].prefetch][:1])
    rows = _gemv_gluon_rows(tmp_path, "--emulate", chosen, "gemv_gluon_emulated.json")
    assert len(rows) == 3 * len(chosen.split(",")) and {(r["layout"], r["group"]) for r in rows} == {
        ("unit order", 128), ("interleaved", 128), ("interleaved", "per channel")}
    assert all(r["rel_error"] <= 2e-3 for r in rows), rows


def test_gluon_gemv_rings_wrap_around(tmp_path):
    """The launches that stream their words through a ring in shared memory (`stages`), emulated
    as compiled for sm_90 on a weight wide enough that each ring wraps (18432 columns: 9 to 18
    iterations against rings of 3 to 8 stages), so a slot is refilled after it was read: y within
    fp16 rounding of the reference, in both layouts and per channel. The persistent ones (a
    persistent launch is a ring's; the TMA rings are persistent) run on 96 rows and one emulated multiprocessor, so each has
    programs that stream two or more blocks of rows through one ring, wrapping it (a block left
    out shows as NaN, one taken for another as error). (At 4096 columns, in the test above, the
    last asks fall past the row and are masked.)"""
    from benchmarks.gemv_gluon import EMULATED_SMS
    from compressors.packed_int_gluon import LAUNCHES, grid

    rings = [i for i, launch in enumerate(LAUNCHES) if launch.stages and not launch.persist]
    persistent = [i for i, launch in enumerate(LAUNCHES) if launch.persist]
    assert {LAUNCHES[i].stages for i in rings} >= {3, 4, 8} and all(LAUNCHES[i].stages for i in persistent)
    for launch in [LAUNCHES[i] for i in persistent]:  # a program with several blocks, and more tiles than its ring holds
        blocks, (programs,) = 96 // launch.block_n, grid(launch, 96, EMULATED_SMS)
        assert programs < blocks and -(-blocks // programs) * 4096 // (8 * launch.words) > launch.stages
    rows = _gemv_gluon_rows(tmp_path, "--emulate", ",".join(map(str, rings)), "gemv_gluon_emulated.json", "--columns", "18432")
    rows += _gemv_gluon_rows(tmp_path, "--emulate", ",".join(map(str, persistent)), "gemv_gluon_emulated.json", "--rows", "96")
    assert len(rows) == 3 * len(rings + persistent) and all(r["rel_error"] <= 2e-3 for r in rows), rows


def test_gluon_gemv_reads_its_words_in_whole_sectors(tmp_path):
    """Every launch serving may pick uses all of every 32-byte sector a warp's load of the
    weight's words touches, and reads each word once, besides what a prefetch launch asks into L2
    ahead of its loads (benchmarks/gemv_gluon.py --traffic, counting the reads of its sm_90 PTX run
    on the CPU). Launches with 8 words a thread hold them as two runs of 4, a warp's width of runs
    apart: 8 consecutive words a thread would touch each sector twice, using half of it each time
    (sector use 0.5)."""
    from compressors.packed_int_gluon import LAUNCHES, SERVED

    rows = _gemv_gluon_rows(tmp_path, "--traffic", ",".join(str(LAUNCHES.index(launch)) for launch in SERVED), "gemv_traffic.json")
    assert len(rows) == len(SERVED) and any("8 words" in row["kernel"] for row in rows)
    for row in rows:
        words = row["words"]
        assert words["sector_use"] == 1.0, row
        assert ("prefetch" in row["kernel"]) == (words["requested_per_weight_byte"] > words["distinct_per_weight_byte"]), row
    # x in shared memory: copied in whole sectors, read back free of bank conflicts, and at most
    # 1 / 2.4 of the wavefronts x takes where the same launch reads it from global memory (2.5-4x
    # fewer: launches with warps along K copy x for fewer rows a block)
    def launch_shape(row):  # the launch without how it takes x (nor whether it sums words in pairs: x is read alike)
        return re.sub(r", x in shared memory|, x by 4-byte loads|, at most \d+ registers| pairs", "", row["kernel"])

    # (a ring's shared loads are its words', counted with x's: those launches are checked for bank conflicts only)
    assert all(row["shared"]["bank_conflicts"] == 0 for row in rows if "ring" in row["kernel"])
    held = [row for row in rows if "x in shared memory" in row["kernel"] and "ring" not in row["kernel"]]
    assert len(held) == sum(launch.xsmem and not launch.stages for launch in SERVED) >= 8
    for row in held:
        assert row["x"]["sector_use"] == 1.0 and row["shared"]["bank_conflicts"] == 0, row
        loaded = [r for r in rows if "x in shared memory" not in r["kernel"] and "ring" not in r["kernel"] and launch_shape(r) == launch_shape(row)]
        x_waves = row["x"]["wavefronts_per_weight_byte"] + row["shared"]["wavefronts_per_weight_byte"]
        assert loaded and all(2.4 * x_waves <= r["x"]["wavefronts_per_weight_byte"] for r in loaded), (row, loaded)


def test_l1_model_fits_recover_the_costs_that_made_the_times():
    """benchmarks/gemv_l1_model.py's fits, on times made from known costs (fixed 2 us, 4 TB/s,
    3.5 ps a wavefront) over kernels of different wavefronts and sizes: the sum fit recovers
    them exactly, with the rate free or held; the max(DRAM, L1) fit finds the max model's own."""
    import numpy as np

    from benchmarks.gemv_l1_model import fit, fit_max

    nbytes = np.array([8.4e6, 29.4e6, 29.4e6, 8.4e6, 29.4e6, 8.4e6])
    waves = nbytes * np.array([0.02, 0.03, 0.08, 0.14, 0.14, 0.05])
    seconds = 2e-6 + nbytes / 4e12 + waves * 3.5e-12
    for found in (fit(nbytes, waves, seconds), fit(nbytes, waves, seconds, rate=4e12)):
        assert found["r2"] > 0.999999 and abs(found["fixed_us"] - 2) < 1e-6 and abs(found["rate_TBps"] - 4) < 1e-6, found
        assert abs(found["wavefront_ps"] - 3.5) < 1e-6 and found["median_abs_error"] < 1e-9, found
    overlapped = 1e-6 + np.maximum(nbytes / 5e12, waves * 4e-12)
    found = fit_max(nbytes, waves, overlapped)
    assert abs(found["rate_TBps"] - 5) < 1e-9 and abs(found["wavefront_ps"] - 4) < 1e-9 and found["r2"] > 0.999999, found


def test_ptx_emulator_counts_the_l1_wavefronts_of_global_and_shared_loads():
    """The L1 wavefronts `gemv_l1_model.py` fits the GEMV's times to: a warp's global load takes
    one per 128-byte line it touches; a shared load goes in phases (8 threads each for 16-byte
    loads), each taking as many wavefronts as the most distinct words one bank holds in it. A
    warp's 16-byte loads 64 bytes apart touch 16 lines, and in shared memory conflict 4 ways
    unless swizzled as `_x_to_shared` does."""
    import numpy as np

    from benchmarks.ptx_emulator import Memory

    lanes = np.arange(32)
    memory = Memory([np.zeros(4096, np.uint8)], base=1 << 20)
    memory.traffic = {}
    base = np.uint64(memory.addresses[0])
    memory.count(base + np.uint64(16) * lanes.astype(np.uint64), 16, lanes)  # 512 contiguous bytes
    assert memory.traffic[0]["lines"] == 4 and memory.traffic[0]["sectors"] == 16
    memory.count(base + np.uint64(64) * lanes.astype(np.uint64), 16, lanes)  # 16 bytes of every 64: half of each sector
    assert memory.traffic[0]["lines"] == 4 + 16 and memory.traffic[0]["sectors"] == 16 + 32
    shared = Memory([np.zeros(4096, np.uint8)], base=0)
    shared.traffic = memory.traffic
    shared.count_banks(np.uint64(64) * lanes.astype(np.uint64), 16, lanes)  # each thread's tile's first 16 bytes, unswizzled
    assert memory.traffic["shared"] == {"loads": 1, "wavefronts": 4 * 4, "conflicts": 4 * 3}
    swizzled = (lanes // 2 % 4).astype(np.uint64)  # piece 0 ^ (tile // 2 % 4)
    shared.count_banks(np.uint64(64) * lanes.astype(np.uint64) + np.uint64(16) * swizzled, 16, lanes)
    assert memory.traffic["shared"] == {"loads": 2, "wavefronts": 16 + 4, "conflicts": 12}
    shared.count_banks(np.zeros(32, np.uint64), 4, lanes)  # one word to every thread: a broadcast
    assert memory.traffic["shared"] == {"loads": 3, "wavefronts": 16 + 4 + 1, "conflicts": 12}


# each of 32 threads copies its 16 bytes of x into shared memory with cp.async, in two commit
# groups (threads' first and second 8 bytes), waits (WAIT), and stores what it then reads to out
_COPY_PTX = _warp_kernel("copy", """
    mul.wide.u32 %rd3, %r1, 16;
    add.s64 %rd4, %rd1, %rd3;
    shl.b32 %r2, %r1, 4;
    mov.b32 %r3, global_smem;
    add.s32 %r4, %r3, %r2;
    cp.async.ca.shared.global [%r4 + 0], [%rd4 + 0], 8, 8;
    cp.async.commit_group;
    cp.async.ca.shared.global [%r4 + 8], [%rd4 + 8], 8, 8;
    cp.async.commit_group;
    WAIT;
    ld.shared.v4.b32 {%r5, %r6, %r7, %r2}, [%r4];
    add.s64 %rd5, %rd2, %rd3;
    st.global.v4.b32 [%rd5 + 0], {%r5, %r6, %r7, %r2};""", shared=True)


@pytest.mark.parametrize("wait", ["cp.async.wait_group 0", "cp.async.wait_group 1", "cp.async.commit_group"])
@pytest.mark.parametrize("access", ["ld.shared.v4.b32 {%r5, %r6, %r7, %r2}, [%r4];", "st.shared.v4.b32 [%r4], {%r1, %r1, %r1, %r1};"])
def test_ptx_emulator_lands_async_copies_at_their_wait(wait, access):
    """A cp.async copy reaches shared memory when a wait lets its commit group go (all but the
    newest n groups), not when issued, and until then a load or store of its bytes raises: on a
    GPU the copy may land before or after it (a pipeline reading a stage before waiting for it,
    or reusing the ring's memory while its last copies are in flight: gemv_mma's 2-stage launch
    did that, and its y was 1.3-1.8e-2 off on an H200)."""
    import numpy as np
    from benchmarks.ptx_emulator import launch

    x = np.arange(32 * 4, dtype=np.uint32) + 1
    out = np.full(32 * 4, 7, np.uint32)
    kernel = _COPY_PTX.replace("WAIT", wait).replace("ld.shared.v4.b32 {%r5, %r6, %r7, %r2}, [%r4];", access + "\n    ld.shared.v4.b32 {%r5, %r6, %r7, %r2}, [%r4];")
    if wait != "cp.async.wait_group 0":
        with pytest.raises(MemoryError, match="in flight"):
            launch(kernel, (1,), [x, out])
        return
    launch(kernel, (1,), [x, out])
    expected = x if access.startswith("ld") else np.arange(32 * 4, dtype=np.uint32) // 4  # each thread's store of its lane
    np.testing.assert_array_equal(out, expected)


# a TMA copy of a 4 x 32 tile of a [6, 40] int32 array (its pointer, then its descriptor, as the
# Gluon GEMV takes them) at (row 3, column 16) into shared memory, on
# an mbarrier that expects EXPECTED bytes, waited for with PARITY; then each of 32 threads copies
# its 16 bytes of the tile to out (the tile's rows past 6 and columns past 40 are zeros)
_TMA_PTX = """.extern .shared .align 16 .b8 global_smem[];
.visible .entry tma(.param .u64 tma_param_0, .param .align 64 .b8 tma_param_1[128], .param .u32 tma_param_2, .param .u32 tma_param_3,
    .param .u64 tma_param_4, .param .u64 tma_param_5, .param .u64 tma_param_6)
.reqntid 32
{
    .reg .pred %p<2>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<8>;
    mov.b32 %r10, tma_param_1;
    cvt.u64.u32 %rd6, %r10;
    cvta.param.u64 %rd7, %rd6;
    ld.param.b64 %rd2, [tma_param_6];
    mov.u32 %r1, %tid.x;
    mov.b32 %r3, global_smem;
    add.s32 %r4, %r3, 512;
    elect.sync %r9|%p1, -1;
    @%p1 mbarrier.init.shared::cta.b64 [%r4], 1;
    fence.proxy.async.shared::cta;
    bar.sync 0;
    @%p1 mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r4], EXPECTED;
    mov.b32 %r5, 16;
    mov.b32 %r6, 3;
    @%p1 cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%r3], [%rd7, {%r5, %r6}], [%r4];
    mov.b32 %r7, PARITY;
    {
    .reg .pred complete;
    waitLoop:
    mbarrier.try_wait.parity.shared::cta.b64 complete, [%r4], %r7;
    @!complete bra.uni waitLoop;
    }
    shl.b32 %r2, %r1, 4;
    add.s32 %r8, %r3, %r2;
    ld.shared.v4.b32 {%r5, %r6, %r7, %r11}, [%r8];
    mul.wide.u32 %rd3, %r1, 16;
    add.s64 %rd5, %rd2, %rd3;
    st.global.v4.b32 [%rd5 + 0], {%r5, %r6, %r7, %r11};
    ret;
}
"""


@pytest.mark.parametrize("case", ["lands", "lands after a barrier", "wrong parity", "fewer bytes expected", "more bytes expected", "never waited",
                                  "before the wait", "asked twice", "refilled unsynced", "one thread waits"])
def test_ptx_emulator_lands_tma_copies_on_their_mbarrier(case):
    """A TMA copy (cp.async.bulk.tensor, the Gluon GEMV's TMA rings) copies its tile, zeros past
    the array's edges, and lands when a wait on its mbarrier's phase completes, which takes the
    arrivals and all the bytes they expect. A wait for a phase already over returns at once, so a
    load of the tile then raises (on a GPU it reads bytes the copy may not have written yet); a
    phase whose bytes do not add up never completes, or is overrun; a block that exits with a copy
    in flight, or copies an array that is not read-only before griddepcontrol.wait, raises; so
    does a slot asked for twice before its wait, and a refill of bytes loaded since the last
    barrier (in lockstep every thread has read them; on a GPU another warp may not have). A
    thread reads the tile only once it has observed the phase: one thread's wait lands it, but
    the others may read it only after a barrier with that thread."""
    import numpy as np
    from benchmarks.ptx_emulator import TensorMap, launch

    array = np.arange(6 * 40, dtype=np.int32).reshape(6, 40)
    out = np.zeros((4, 32), np.int32)
    kernel = _TMA_PTX.replace("EXPECTED", "512").replace("PARITY", "0")
    one_waits = kernel.replace("    mbarrier.try_wait", "    @%p1 mbarrier.try_wait").replace("    @!complete bra.uni waitLoop;\n", "")
    if case.startswith("lands"):
        if case == "lands after a barrier":  # only the elected thread waits; the barrier after its wait orders the tile for all
            kernel = one_waits.replace("    shl.b32 %r2", "    bar.sync 0;\n    shl.b32 %r2")
        launch(kernel, (1,), [array, TensorMap(0, (4, 32)), out])
        expected = np.zeros((4, 32), np.int32)
        expected[:3, :24] = array[3:, 16:]
        np.testing.assert_array_equal(out, expected)
        return
    raised = {"wrong parity": (MemoryError, "in flight"), "fewer bytes expected": (MemoryError, "more bytes"),
              "more bytes expected": (RuntimeError, "never completes"), "never waited": (MemoryError, "exits with a TMA copy in flight"),
              "before the wait": (MemoryError, "before griddepcontrol.wait"), "asked twice": (MemoryError, "more arrivals"),
              "refilled unsynced": (MemoryError, "loaded since the last barrier"), "one thread waits": (MemoryError, "has not waited for")}
    ask = "    @%p1 mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r4], 512;\n    @%p1 cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%r3], [%rd7, {%r5, %r6}], [%r4];\n"
    if case == "wrong parity":
        kernel = kernel.replace("mov.b32 %r7, 0;", "mov.b32 %r7, 1;")
    elif case.endswith("bytes expected"):
        kernel = kernel.replace("_, [%r4], 512;", "_, [%r4], 256;" if case.startswith("fewer") else "_, [%r4], 1024;")
    elif case == "asked twice":
        kernel = kernel.replace("    mov.b32 %r7, 0;", ask.replace("%r5, %r6", "%r8, %r8").replace("    @%p1 mbarrier", "    mov.b32 %r8, 0;\n    @%p1 mbarrier", 1)
                                + "    mov.b32 %r7, 0;")
    elif case == "refilled unsynced":
        kernel = kernel.replace("    mul.wide.u32 %rd3, %r1, 16;", ask.replace("%r5, %r6", "%r9, %r9").replace("    @%p1 mbarrier", "    mov.b32 %r9, 0;\n    @%p1 mbarrier", 1)
                                + "    mul.wide.u32 %rd3, %r1, 16;")
    elif case == "never waited":
        kernel = kernel[:kernel.index("    mov.b32 %r7")] + "    ret;\n}\n"
    elif case == "one thread waits":  # the others read the tile it landed with no barrier between
        kernel = one_waits
    else:
        kernel = kernel.replace("    @%p1 cp.async.bulk", "    griddepcontrol.wait;\n    @%p1 cp.async.bulk")
        launch(kernel, (1,), [array, TensorMap(0, (4, 32)), out], read_only=(0,))  # a weight's copy may go first
        kernel = kernel.replace("    griddepcontrol.wait;\n    @%p1 cp.async.bulk", "    @%p1 cp.async.bulk").replace("    mov.b32 %r7", "    griddepcontrol.wait;\n    mov.b32 %r7")
    error, message = raised[case]
    with pytest.raises(error, match=message):
        launch(kernel, (1,), [array, TensorMap(0, (4, 32)), out])


# each of 32 threads prefetches its x[lane], waits for the kernel before (griddepcontrol.wait),
# copies x[lane] to out[lane] and lets the next kernel launch: a programmatic dependent's order
_DEPENDENT_PTX = _warp_kernel("dependent", """
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd1, %rd3;
    add.s64 %rd5, %rd2, %rd3;
    prefetch.global.L2 [%rd4];
    griddepcontrol.wait;
    ld.global.b32 %r2, [%rd4 + 0];
    st.global.b32 [%rd5 + 0], %r2;
    griddepcontrol.launch_dependents;""")


@pytest.mark.parametrize("early", [None, "ld.global.b32 %r3, [%rd4 + 0];", "st.global.b32 [%rd5 + 0], %r1;"])
def test_ptx_emulator_faults_a_dependent_launch_that_touches_memory_before_its_wait(early):
    """Launched as a programmatic dependent (the grid kernels on sm_90, `packed_int.pdl_launch`),
    a kernel may start while the one before it still runs: before griddepcontrol.wait it may
    prefetch, but a load could read x before it is written and a store write y while it is still
    read. The emulator raises on either, so `kernel_sass.py --check` (which runs every grid
    kernel's PTX as launched on sm_90) would catch a compiler or a kernel moving one ahead. A
    load of an array the launch names read-only (a weight, which no kernel before writes) may
    go first; a load of another array, or any store, still raises."""
    import numpy as np
    from benchmarks.ptx_emulator import launch

    x, out = np.arange(32, dtype=np.float32), np.zeros(32, np.float32)
    if early is None:
        launch(_DEPENDENT_PTX, (1,), [x, out])
        np.testing.assert_array_equal(out, x)
        return
    kernel = _DEPENDENT_PTX.replace("    griddepcontrol.wait;", f"    {early}\n    griddepcontrol.wait;")
    for read_only in [(), (1,)] + ([(0, 1)] if early.startswith("st") else []):
        with pytest.raises(MemoryError, match="before griddepcontrol.wait"):
            launch(kernel, (1,), [x, out], read_only=read_only)
    if early.startswith("ld"):  # x named read-only: its early load is allowed
        launch(kernel, (1,), [x, out], read_only=(0,))
        np.testing.assert_array_equal(out, x)


# each of 32 threads adds its fp16 x[lane] into out[lane % 4] with an atomic that returns the
# value it replaced (Triton 3.6 compiles split-K's adds so), which it stores to out[4 + lane]
_ATOMIC_PTX = _warp_kernel("atomic", """
    .reg .b16 %rs<3>;
    mul.wide.u32 %rd3, %r1, 2;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.b16 %rs1, [%rd4 + 0];
    and.b32 %r2, %r1, 3;
    mul.wide.u32 %rd5, %r2, 2;
    add.s64 %rd5, %rd2, %rd5;
    atom.global.gpu.relaxed.add.noftz.f16 %rs2, [%rd5 + 0], %rs1;
    add.s64 %rd4, %rd2, %rd3;
    st.global.b16 [%rd4 + 8], %rs2;""")


def test_ptx_emulator_adds_atomically_and_returns_the_value_replaced():
    """atom...add (the split-K GEMV and GEMM as the H100 image's Triton 3.6 compiles them, where
    3.9 emits red): each thread's add lands in turn, and each gets back the sum before its own."""
    import numpy as np
    from benchmarks.ptx_emulator import launch

    x = np.arange(1, 33, dtype=np.float16)
    out = np.zeros(4 + 32, np.float16)
    launch(_ATOMIC_PTX, (1,), [x.view(np.int16), out.view(np.int16)])
    by_slot = x.reshape(8, 4)
    np.testing.assert_array_equal(out[:4], by_slot.sum(axis=0))
    np.testing.assert_array_equal(out[4:].reshape(8, 4), np.cumsum(by_slot, axis=0) - by_slot)


# each of 32 threads loads its signed byte x[lane] (ld.s8 sign-extends into the 16-bit register),
# converts it to fp32 and stores it; it also packs the byte's register with one never written
# (LLVM's undef, which Triton 3.6 emits where only the low half is read) and stores both halves
_BYTES_PTX = _warp_kernel("bytes", """
    .reg .b16 %rs<4>;
    cvt.u64.u32 %rd3, %r1;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.s8 %rs1, [%rd4 + 0];
    cvt.rn.f32.s16 %r2, %rs1;
    mul.wide.u32 %rd3, %r1, 8;
    add.s64 %rd5, %rd2, %rd3;
    st.global.b32 [%rd5 + 0], %r2;
    mov.b32 %r3, {%rs1, %rs3};
    st.global.b32 [%rd5 + 4], %r3;""")


def test_ptx_emulator_sign_extends_signed_loads_and_poisons_undefined_parts():
    """Two PTX details Triton 3.6 (the H100 image's compiler) relies on where 3.9 does not, found
    when `kernel_sass.py --check` ran with it: int8 zero points loaded with ld.s8 into a wider
    register are sign-extended (read as unsigned, a zero point of -1 became 255); and a register
    packed beside one never written reads that part as all ones (a NaN or -1), so a kernel that
    did use it fails its check instead of passing by luck."""
    import numpy as np
    from benchmarks.ptx_emulator import launch

    x = np.arange(-16, 16, dtype=np.int8)
    out = np.zeros((32, 2), np.uint32)
    launch(_BYTES_PTX, (1,), [x, out])
    np.testing.assert_array_equal(out[:, 0].view(np.float32), x.astype(np.float32))
    np.testing.assert_array_equal(out[:, 1] & 0xFFFF, x.astype(np.int16).view(np.uint16))
    assert (out[:, 1] >> 16 == 0xFFFF).all()


def test_tensor_core_gemv_computes_as_compiled_for_hopper(tmp_path):
    """The GEMV on the tensor cores (benchmarks/gemv_mma.py: each word decodes to its
    thread's mma.sync fragment; a GPU experiment, not served), compiled for sm_90 and its PTX run
    on the CPU: with one and several tiles and chunks a thread, warps split along K (summed
    across warps), prefetching into L2 (its byte ranges checked to stay inside the weight), and
    the words through a cp.async ring in shared memory (wrapping; each copy lands at its wait);
    x of one row in groups of 64 and 128 and per channel, and of 5 and 8 rows (B's columns). The layout's permutation of K is the part a mistake
    would break: any slip is of order 1."""
    import subprocess
    import sys

    from benchmarks.gemv_mma import LAUNCHES, Launch

    chosen = [Launch(1, 4, 1), Launch(2, 2, 4), Launch(1, 4, 2, 2), Launch(2, 4, 1, 2), Launch(1, 4, 2, 0, 4)]
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gemv_mma.py")
    result = subprocess.run([sys.executable, script, "--emulate", "--launches", ",".join(str(LAUNCHES.index(launch)) for launch in chosen),
                             "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "gemv_mma_emulated.json").read_text())
    assert len(rows) == 5 * len(chosen) and {r["batch"] for r in rows} == {1, 5, 8} and all(r["rel_error"] <= 2e-3 for r in rows), rows


def test_gluon_gemv_serves_only_the_weights_it_fits(monkeypatch):
    """The Gluon GEMV has no masks and decodes symmetric 4-bit words only: a launch takes a weight
    when its groups hold whole words (per channel too) and its rows and K are whole blocks of
    the launch; every launch serving may pick takes 4096- and 14336-wide layers. Serving
    considers it only for fp16 x on CUDA with autotuning on (it is picked by timing) and not
    turned off; everywhere else the grid GEMV serves, as before."""
    import dataclasses

    from compressors import packed_int_gluon

    launch = packed_int_gluon.Launch(1, 2, 4, 0, 1, 4)  # 8 rows x 128 words: 1024 columns a block
    assert packed_int_gluon.fits(random_packed(4, 64, 2048, 128), launch)
    assert packed_int_gluon.fits(random_packed(4, 64, 2048, None), launch)  # per channel: GROUP = K
    assert packed_int_gluon.fits(random_packed(4, 64, 2048, 32), launch)
    for weight in (random_packed(4, 64, 2048, 128, "asymmetric"), random_packed(4, 64, 2048, None, "codebook"),
                   random_packed(4, 64, 2048, 128, "2:4 symmetric"), random_packed(3, 64, 2048, 128), random_packed(8, 64, 2048, 128),
                   random_packed(4, 60, 2048, 128), random_packed(4, 64, 1536, 128), random_packed(4, 64, 2048, 4)):
        assert not packed_int_gluon.fits(weight, launch), weight
    for columns in (4096, 14336):  # the layer widths it is meant for: every launch serving may pick takes them
        assert all(packed_int_gluon.fits(random_packed(4, 64, columns, 128), served) for served in packed_int_gluon.SERVED)
    wide = random_packed(4, 8, packed_int_gluon.X_SHARED_BYTES // 2 + 1024, 128)  # x past what a launch holds in shared memory
    held = packed_int_gluon.Launch(1, 2, 4, 0, 1, 4, xsmem=1)
    assert packed_int_gluon.fits(wide, launch) and not packed_int_gluon.fits(wide, held)
    assert packed_int_gluon.fits(random_packed(4, 8, packed_int_gluon.X_SHARED_BYTES // 2, 128), held)
    # by TMA, the words' rows must start 16-byte aligned (the copy engine's rule): a view whose rows start 4 bytes off is not
    by_tma = next(served for served in packed_int_gluon.SERVED if served.tma)
    aligned = random_packed(4, 64, 4096, 128)
    shifted = dataclasses.replace(aligned, packed=torch.cat([aligned.packed.new_zeros(64, 1), aligned.packed], dim=1)[:, 1:])
    assert packed_int_gluon.fits(aligned, by_tma) and not packed_int_gluon.fits(shifted, by_tma)
    assert packed_int_gluon.fits(shifted, by_tma._replace(tma=0))  # its cp.async twin takes it
    weight, x = random_packed(4, 64, 2048, 128), torch.randn(1, 2048).half()
    never = lambda: pytest.fail("timed on the CPU")  # noqa: E731
    assert packed_int_gluon.served_launch(x, weight, never) is None  # the CPU
    if torch.cuda.is_available():
        for setting, value in (("LMPRESS_GLUON", "0"), ("LMPRESS_AUTOTUNE", "0")):
            with monkeypatch.context() as env:
                env.setenv(setting, value)
                assert packed_int_gluon.served_launch(x.cuda(), weight.to("cuda"), never) is None
        assert packed_int_gluon.served_launch(x.cuda().float(), weight.to("cuda"), never) is None


def test_gluon_gemv_pick_falls_back_to_the_grid_gemv_where_nothing_can_be_timed():
    """Serving picks the batch-1 GEMV by timing candidates in a CUDA graph; where none can be
    captured (here: no GPU at all, which is where `weight_seconds` fails first) the pick warns
    once and the grid GEMV serves, instead of the first call failing."""
    from compressors import packed_int_gluon

    weight, x = random_packed(4, 64, 2048, 128), torch.randn(1, 2048).half()
    grid_gemv = lambda out, copy=weight: out.copy_(matmul_reference(x, copy))  # noqa: E731  (the grid GEMV's contract: y into `out`)
    launches = [launch for launch in packed_int_gluon.SERVED if packed_int_gluon.fits(weight, launch)]
    assert launches
    if torch.cuda.is_available():
        pytest.skip("CUDA graphs can be captured here")
    with pytest.warns(UserWarning, match="could not be timed in a CUDA graph"):
        assert packed_int_gluon._fastest(x, weight, grid_gemv, launches) is None


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Gluon kernels run on a GPU only (here: their PTX, emulated, above)")
def test_gluon_gemv_matches_the_reference_and_serves_where_it_is_faster(monkeypatch):
    """On a GPU: every Gluon launch in both layouts, in groups of 128 and per channel, against
    the reference; then served, `matmul_triton` at batch 1 picks it or the grid GEMV by timing
    (here against the grid GEMV's first launch shape where LMPRESS_AUTOTUNE=0 fixed it at
    import), with the same y either way. And each persistent launch on a weight with twice its
    programs' blocks of rows but one, so all but one of its programs stream two blocks through
    their ring (a block left out shows as NaN)."""
    from compressors import packed_int_gluon

    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(0)).half().to(DEVICE)
    for launch in [launch for launch in packed_int_gluon.LAUNCHES if launch.persist]:
        programs = launch.persist * packed_int_gluon._sm_count(DEVICE.index)
        weight = packed(4, launch.block_n * (2 * programs - 1), 4096, 128).interleave()
        reference = matmul_reference(x, weight).float()
        y = torch.full((1, weight.rows), float("nan"), dtype=torch.float16, device=DEVICE)
        error = ((packed_int_gluon.run(x, weight, y, launch).float() - reference).norm() / reference.norm()).item()
        assert error <= 2e-3, (launch, error)
    for group in (128, None):
        weight = packed(4, 256, 4096, group)
        reference = matmul_reference(x, weight).float()
        for stored in (weight, weight.interleave()):
            for launch in packed_int_gluon.LAUNCHES:
                y = torch.full((1, 256), float("nan"), dtype=torch.float16, device=DEVICE)
                error = ((packed_int_gluon.run(x, stored, y, launch).float() - reference).norm() / reference.norm()).item()
                assert error <= 2e-3, (launch, stored.interleaved, group, error)
        monkeypatch.delenv("LMPRESS_AUTOTUNE", raising=False)
        served = matmul_triton(x, weight.interleave())
        assert ((served.float() - reference).norm() / reference.norm()).item() <= 2e-3, packed_int_gluon.picked(x, weight.interleave())


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU (here: the same steps eagerly, test_search.py)")
def test_decode_steps_with_packed_linears_replay_as_cuda_graphs():
    """On a GPU, with every decoder linear packed: a decode step captured once (`capture_graph`,
    as `lmpress latency` and `generate` capture it) and replayed after each prefill decodes what
    the eager step does; generate's graphed greedy loop gives the eager loop's tokens; the
    latency table's graphed step times."""
    from compressors.kernels import capture_graph
    from pipelines.latency import LatencyConfig, _linears_swapped, decode_step, decode_step_seconds, serving_module
    from pipelines.serving import greedy_decode

    model = tiny_model("llama").to(DEVICE, torch.float16)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name}
    packed_linears = {name: serving_module("bits4g32", m.out_features, m.in_features, torch.float16, DEVICE)[0] for name, m in linears.items()}
    config = LatencyConfig(context=24, repeats=3, device="cuda")
    with _linears_swapped(model, packed_linears), torch.no_grad():
        prefill, step = decode_step(model, config, DEVICE)
        prefill()
        eager = step().clone()
        out = {}
        graph = capture_graph(lambda: out.update(logits=step()), warm_up=lambda: (prefill(), step(), prefill()))  # captured from a prefilled state
        for _ in range(2):
            prefill()
            graph.replay()
            torch.testing.assert_close(out["logits"], eager)
        prompt = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        tokens, graphed = greedy_decode(model, prompt, 16, cuda_graph=True)
        assert graphed and torch.equal(tokens, greedy_decode(model, prompt, 16)[0])
        assert decode_step_seconds(model, config, DEVICE) > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="builds its 32 inputs with Python, which only the interpreter runs")
def test_3bit_decode_tile_lists_the_codes_in_order():
    """The GEMM's 3-bit PTX decode returns 32 tensors, c[j] holding code j of each unit (the
    emulator test above checks that); `_in_code_order32` joins them into the tile, which must
    hold code j at column j of each unit, as the Triton decode's tile does."""
    @triton.jit
    def kernel(out_ptr):
        rows, units = tl.arange(0, 2)[:, None], tl.arange(0, 4)[None, :]
        c = tuple((rows * 4 + units) * 100 + j for j in range(32))  # the interpreter runs this as Python
        tile = _in_code_order32(c, 2, 4)
        tl.store(out_ptr + tl.arange(0, 2)[:, None, None] * 128 + tl.arange(0, 4)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :], tile)

    out = torch.empty(2, 4, 32, dtype=torch.int32)
    kernel[(1,)](out)
    expected = (torch.arange(8).reshape(2, 4, 1) * 100 + torch.arange(32)).to(torch.int32)
    assert torch.equal(out, expected)


def test_interleaving_applies_only_where_a_tile_fits(tmp_path):
    """A tile of 4 units must be whole and inside one group; 2:4 weights keep unit order. The
    layout survives a spill to disk; repacking twice is refused."""
    from compressors.packed_int import read_spilled, spill_to_disk
    from pipelines.errors import LmpressError

    assert packed(4, 8, 128, 32).can_interleave() and packed(3, 8, 256, 128).can_interleave()
    assert not packed(4, 8, 80, None).can_interleave()  # 80 columns: 2.5 tiles
    assert not packed(3, 8, 256, 64).can_interleave()  # a 3-bit tile is 128 columns, two groups of 64
    assert not packed(4, 8, 64, 32, "2:4 symmetric").can_interleave() and not packed(4, 8, 200, 100).can_interleave()
    weight = packed(4, 8, 128, 32, "asymmetric").interleave()
    with pytest.raises(LmpressError, match="no interleaved layout"):
        weight.interleave()
    spill_to_disk({"w": weight.to("cpu")}, tmp_path / "spill.safetensors")
    back = read_spilled(tmp_path / "spill.safetensors")["w"]
    assert back.interleaved and torch.equal(dequantize_reference(back), dequantize_reference(weight.to("cpu")))


def test_serving_layout_interleaves_3_4_and_8_bit_grids_on_cuda_only(monkeypatch):
    """CUDA serves 3-, 4- and 8-bit grids interleaved (timed faster), 2-bit grids, codebooks and
    2:4 weights in unit order; LMPRESS_INTERLEAVE=0 turns it off, =1 interleaves every weight
    that can be; the CPU serves a dense copy, so it never repacks."""
    from compressors.kernels import serving_layout

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    int4, int8, int3 = random_packed(4, 8, 128, 32, "asymmetric"), random_packed(8, 8, 64, 32), random_packed(3, 8, 256, 128)
    int2, codebook, sparse = random_packed(2, 8, 128, 64), random_packed(4, 8, 128, None, "codebook"), random_packed(4, 8, 64, 32, "2:4 symmetric")
    monkeypatch.delenv("LMPRESS_INTERLEAVE", raising=False)
    for weight in (int4, int8, int3):
        served = serving_layout(weight, cuda)
        assert served.interleaved and torch.equal(dequantize_reference(served), dequantize_reference(weight))
        assert serving_layout(served, cuda) is served and serving_layout(weight, cpu) is weight
    for weight in (int2, codebook, sparse):
        assert serving_layout(weight, cuda) is weight
    monkeypatch.setenv("LMPRESS_INTERLEAVE", "0")
    assert serving_layout(int4, cuda) is int4 and serving_layout(int3, cuda) is int3
    monkeypatch.setenv("LMPRESS_INTERLEAVE", "1")
    assert serving_layout(int2, cuda).interleaved and serving_layout(codebook, cuda).interleaved
    assert serving_layout(sparse, cuda) is sparse and serving_layout(int3, cpu) is int3


def test_fp16_2_4_weights_serve_from_a_dense_copy():
    """On CUDA a 2:4 weight with fp16 values takes the dense path (its kernel was timed 5-20x
    slower than dense fp16), as every weight does on the CPU; quantized 2:4 weights keep their
    kernel (choosing it needs a GPU's self-check, so only the fp16 case is decided here)."""
    from compressors.kernels import serving_kernel

    sparse_fp16 = random_packed(16, 8, 64, None, "2:4 fp16")
    assert serving_kernel(sparse_fp16, torch.device("cuda")) is None and serving_kernel(sparse_fp16, torch.device("cpu")) is None
    linear = PackedLinear(sparse_fp16, None)
    x = torch.randn(3, 64)
    torch.testing.assert_close(linear(x), x @ dequantize_reference(sparse_fp16).T)


def test_a_repacked_linear_saves_and_loads_the_artifacts_layout():
    """A PackedLinear repacked for serving still has the artifact's layout as its state, and
    loading state returns it to that layout (the next CUDA call repacks again)."""
    weight = random_packed(4, 8, 128, 32)
    repacked = PackedLinear(weight.interleave(), None)
    state = repacked.state_dict()
    assert torch.equal(state["packed"], weight.packed) and repacked.interleaved
    fresh = PackedLinear(weight, None)
    fresh.load_state_dict(state)
    repacked.load_state_dict(PackedLinear(weight, None).state_dict())
    x = torch.randn(3, 128)
    for module in (fresh, repacked):
        assert not module.interleaved and torch.allclose(module(x), matmul_reference(x, weight), atol=1e-5)


def test_writers_store_the_artifacts_layout(tmp_path):
    """An interleaved weight handed to a writer is stored in unit order, the layout loaders read."""
    from compressors.lmpress_format import save_lmpress_packed
    from compressors.packed_int import save_pack_quantized
    from compressors.grid import GridSpec
    from pipelines.serving import packed_weights

    name, weight = "model.layers.0.self_attn.q_proj", random_packed(4, 64, 64, 32)
    save_lmpress_packed(tiny_model("llama"), {name: weight.interleave()}, tmp_path / "lmpress")
    save_pack_quantized(tiny_model("llama"), {name: weight.interleave()}, {name: GridSpec(bits=4, group_size=32)}, tmp_path / "ct")
    for folder in ("lmpress", "ct"):
        assert torch.equal(packed_weights(tmp_path / folder)[name].packed, weight.packed), folder


def test_whole_blocks_drop_the_k_mask_only_where_every_block_is_whole():
    """The GEMV and GEMM load words unmasked along K (so 128 bits at a time) only when K splits
    into whole units and whole blocks for the launch shape (split-K slices start at blocks)."""
    from compressors.packed_int import _whole_blocks

    shape = lambda K, bits=4, words=128, split=1, sparse=False: dict(K=K, BITS=bits, WORDS=words, SPLIT_K=split, SPARSE24=sparse)  # noqa: E731
    assert _whole_blocks(shape(4096)) and _whole_blocks(shape(4096, split=4)) and _whole_blocks(shape(14336, split=2))
    assert _whole_blocks(shape(4096, split=8)) and not _whole_blocks(shape(1344)) and not _whole_blocks(shape(4100))
    assert _whole_blocks(shape(4096, bits=3, words=128)) and not _whole_blocks(shape(4000, bits=3, words=128))  # 32 units a block
    assert _whole_blocks(shape(2048, sparse=True)) and not _whole_blocks(shape(4096 + 64, words=256, sparse=True))


def test_split_k_launches_one_program_a_block_at_most():
    """The kernels assume every slice of K is non-empty (`_k_slice`; the interpreter checks the
    assumption in every launch-shape test), so a split finer than K's blocks launches fewer."""
    from compressors.packed_int import k_slices

    meta = lambda bits, words, split, sparse=False: dict(BITS=bits, WORDS=words, SPLIT_K=split, SPARSE24=sparse)  # noqa: E731
    assert k_slices(4096, meta(4, 16, 4)) == 4 and k_slices(576, meta(4, 16, 4)) == 4  # 72 units: 5 blocks of 16
    assert k_slices(576, meta(4, 64, 4)) == 2 and k_slices(576, meta(4, 128, 2)) == 1 and k_slices(200, meta(8, 16, 4)) == 4
    assert k_slices(192, meta(2, 16, 4, sparse=True)) == 1 and k_slices(1312, meta(3, 64, 4)) == 3  # 2:4: 6 words; 3 bits: 41 units, 16 a block


def test_tuner_keeps_its_pick_per_setting_that_changes_the_compiled_code():
    """The autotuner reuses a pick for every launch with the same key, so the key must hold each
    constexpr the kernel compiles differently for, other than the launch shape it picks and EVEN
    (which follows from K). A searched plan serves group sizes 64 and 128 at one layer shape."""
    import inspect

    from compressors.packed_int import GEMM_CONFIGS, GEMM_KEY, GEMV_CONFIGS, GEMV_KEY, _grid_gemm_kernel, _grid_gemv_kernel

    for kernel, configs, key in [(_grid_gemv_kernel, GEMV_CONFIGS, GEMV_KEY), (_grid_gemm_kernel, GEMM_CONFIGS, GEMM_KEY)]:
        parameters = inspect.signature(kernel.fn).parameters.values()  # the Python function, compiled or interpreted
        constexprs = {p.name for p in parameters if "constexpr" in str(p.annotation)}
        picked = set().union(*(config.kwargs for config in configs)) | {"EVEN"}
        assert constexprs - picked <= set(key), constexprs - picked - set(key)
        assert {"N", "K"} <= set(key)


def test_kernels_launch_as_programmatic_dependents_on_hopper_only(monkeypatch):
    """PDL needs compute capability 9.0 (griddepcontrol); the kernel's PDL constexpr (its wait)
    and the launch attribute go together, or a kernel could start early with nothing holding
    its reads back; LMPRESS_PDL=0 turns both off, and CPU launches never take them."""
    from compressors import packed_int

    monkeypatch.delenv("LMPRESS_PDL", raising=False)
    monkeypatch.setattr(packed_int, "_capability", lambda index: (9, 0))
    assert packed_int.pdl_launch(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    assert packed_int.pdl_launch(torch.device("cpu")) == {}
    monkeypatch.setenv("LMPRESS_PDL", "0")
    assert packed_int.pdl_launch(torch.device("cuda", 0)) == {}
    monkeypatch.delenv("LMPRESS_PDL")
    monkeypatch.setattr(packed_int, "_capability", lambda index: (8, 0))
    assert packed_int.pdl_launch(torch.device("cuda", 0)) == {}


def test_speed_benchmark_splits_batch1_time_into_a_fixed_cost_and_a_rate():
    """kernel_speed.py's fit over the shapes timed: stop 40's two points of the served GEMV on an
    H100 (8.65 MB in 6.86 us, 30.28 MB in 16.09 us; benchmarks/results/gemv_stages_h100.md) give
    its 3.2 us a call and 2.35 TB/s; batched rows and a single size give no fit."""
    from benchmarks.kernel_speed import fixed_and_rate

    rows = [{"batch": 1, "int4_bytes": 8.65e6, "int4_us": 6.86}, {"batch": 1, "int4_bytes": 30.28e6, "int4_us": 16.09},
            {"batch": 16, "int4_us": 20.0}]
    assert fixed_and_rate(rows, "int4") == {"fixed_us": 3.17, "rate_TBps": 2.34, "shapes": 2}
    assert fixed_and_rate(rows[:1] + rows[2:], "int4") is None and fixed_and_rate(rows, "fp16") is None


def test_read_stream_xors_every_word_of_its_chunks():
    """The read-only roof of kernel_speed.py reads every word (its XOR per 64 KiB chunk is numpy's),
    so a GPU cannot skip loads and report a rate no kernel could reach."""
    import numpy as np

    from benchmarks.kernel_speed import READ_BLOCK, READ_ITERATIONS, xor_words

    chunk = READ_BLOCK * READ_ITERATIONS
    words = torch.randint(-(1 << 31), 1 << 31, (3 * chunk,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    expected = np.bitwise_xor.reduce(words.numpy().reshape(3, chunk), axis=1)
    assert np.array_equal(xor_words(words).numpy(), expected)
    words[chunk + 5] ^= 1 << 7  # one bit of one word changes its chunk's XOR, only that one
    assert (xor_words(words).numpy() != expected).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="whole chunks"):
        xor_words(words[:-1])


def test_split_k_is_not_tried_for_bf16_outputs():
    """bf16 has 8 significant bits: partial sums added in it would lose the fp32 accumulation."""
    from compressors.packed_int import GEMV_CONFIGS, _split_k_fits

    bf16, fp16 = (torch.empty(1, 4, dtype=dtype) for dtype in (torch.bfloat16, torch.float16))
    assert {c.kwargs["SPLIT_K"] for c in _split_k_fits(GEMV_CONFIGS, {"y_ptr": bf16})} == {1}
    assert {c.kwargs["SPLIT_K"] for c in _split_k_fits(GEMV_CONFIGS, {"y_ptr": fp16})} > {1}


@pytest.mark.parametrize("shard", ["1/3", "2/3", "3/3"])  # about 100 s each, so the workers share them
def test_kernels_compile_for_hopper(shard):
    """The interpreter runs a kernel's Python, not the compiler: a kernel can pass every test
    above and still fail to compile (a static branch's dead return, say). Triton ships ptxas,
    so every decode path is lowered to sm_90 machine code here, with no GPU, and must draw no
    performance warning from ptxas (the GEMM's wgmma serialized, say: C7515, which zeroing the
    accumulator on a path that skips the K loop caused; `_k_slice`). Register spills are
    listed, not failed: they depend on the launch shape, which the autotuner times. Each path's
    PTX (GEMV and GEMM, grid and general), as compiled, is also run on the CPU
    (benchmarks/ptx_emulator.py) on a random weight of its kind, for fp16, bf16 and fp32
    activations, as is the dequantize kernel's, and must match the reference within the
    output's rounding: the inline PTX in place, the layouts, the masks, the tensor-core
    fragments and swizzled shared tiles, split-K's atomics."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "kernel_sass.py")
    result = subprocess.run([sys.executable, script, "--check", "--shard", shard], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
