"""`lmpress publish` against a real HTTP server on 127.0.0.1 that speaks the hub's upload API
(tests/hub_server.py): the real huggingface_hub client uploads, nothing of it is mocked."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from pipelines.errors import LmpressError
from conftest import leftovers, run_cli
from hub_server import LocalHub

TOKEN = "hf_lmpress_test_token"


def hub_env(hub: LocalHub, tmp_path: Path, token: str | None = TOKEN) -> dict:
    """The CLI's environment: this hub, its token (or none at all), LFS uploads (the test server
    speaks the LFS protocol, not Xet) and no stored login from the machine."""
    env = {key: value for key, value in os.environ.items() if key != "HF_TOKEN"}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(tmp_path / "hf-home"), LMPRESS_QUIET="1")
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def in_process_client(monkeypatch, tmp_path: Path) -> None:
    """The same settings as hub_env for huggingface_hub in this process (it read the environment
    at import; its constants are what it checks at each call)."""
    from huggingface_hub import constants

    for name, value in (("HF_HUB_OFFLINE", False), ("HF_HUB_DISABLE_XET", True), ("HF_HUB_DISABLE_TELEMETRY", True)):
        monkeypatch.setattr(constants, name, value)
    for name in ("HF_TOKEN_PATH", "HF_STORED_TOKENS_PATH"):  # no login stored on this machine counts
        monkeypatch.setattr(constants, name, str(tmp_path / name))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, real_model_folder) -> tuple[Path, Path]:
    """A 4-bit RTN artifact of a tiny Llama and a folder holding its and its base's evaluate
    metrics. (The real model's card is checked by test_dvc's publish stage, a dry run.)"""
    from conftest import save_tiny, tiny_config
    from pipelines.stages import EvaluateConfig, QuantizeConfig, evaluate, quantize

    root = tmp_path_factory.mktemp("publish")
    base, artifact = save_tiny(root / "tiny", tiny_config("llama"), real_model_folder), root / "tiny-rtn4"
    quantize(str(base), None, artifact, QuantizeConfig(method="rtn", bits=4, group_size=32))
    settings = EvaluateConfig(windows=1, seq_len=64)
    evaluate(str(artifact), root / "reference", root / "metrics" / "quantized.json", settings)
    evaluate(str(base), root / "reference", root / "metrics" / "base.json", settings)
    return artifact, root / "metrics"


def test_publish_sends_every_file_in_one_commit_and_the_download_reloads(quantized, tmp_path, monkeypatch):
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM

    from pipelines.models import load_model

    artifact, metrics = quantized
    with LocalHub() as hub:
        result = run_cli(
            "publish", artifact, "--repo-id", "tester/tiny-rtn4", "--private", "--metrics", metrics, "--receipt", tmp_path / "receipt.json",
            env=hub_env(hub, tmp_path),
        )
        assert result.returncode == 0, result.stderr
        assert TOKEN not in result.stdout + result.stderr
        arrived = hub.files("tester/tiny-rtn4")
        local = {str(p.relative_to(artifact)): p.read_bytes() for p in artifact.rglob("*") if p.is_file()}
        assert set(arrived) == {*local, "README.md"} and all(arrived[name] == data for name, data in local.items())
        (commit,) = hub.commits("tester/tiny-rtn4")
        lineage = json.loads((artifact / "lineage.json").read_text())
        assert lineage["hash"][:12] in commit["message"]
        receipt = json.loads((tmp_path / "receipt.json").read_text())
        assert receipt["uploaded"] and receipt["new_commit"] and receipt["commit"] == commit["oid"] and receipt["files"]["README.md"]["bytes"] == len(arrived["README.md"])

        assert hub.repos()["tester/tiny-rtn4"]["private"]

        in_process_client(monkeypatch, tmp_path)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        from pipelines.publish import PublishConfig, publish

        again = publish(artifact, PublishConfig(repo_id="tester/tiny-rtn4", revision="candidate", endpoint=hub.url, metrics=str(metrics)))
        assert hub.files("tester/tiny-rtn4", "candidate") == arrived  # a new branch from main, with the same bytes
        assert not again["new_commit"] and len(hub.commits("tester/tiny-rtn4")) == 1  # nothing changed: no empty commit
        downloaded = Path(snapshot_download(
            "tester/tiny-rtn4", endpoint=hub.url, token=TOKEN, local_dir=tmp_path / "download", cache_dir=tmp_path / "hf-cache",
        ))

    card = (downloaded / "README.md").read_text()
    assert TOKEN not in card
    front = card.split("---")[1]
    for line in ("library_name: transformers", "license: other", "pipeline_tag: text-generation", "- compressed-tensors"):
        assert line in front, line
    assert "base_model" not in front  # a local folder is no hub id: the card claims no base it cannot name
    base_ppl = json.loads((metrics / "base.json").read_text())["austen-heldout"]["perplexity"]
    ppl = json.loads((metrics / "quantized.json").read_text())["austen-heldout"]["perplexity"]
    assert f"| perplexity, austen-heldout | {base_ppl:.4g} | {ppl:.4g} |" in card
    assert "gpu_validated: false" in card and "vllm serve tester/tiny-rtn4" in card and "## Calibration data" not in card  # RTN reads none
    assert "license was not recorded" in card

    stock = AutoModelForCausalLM.from_pretrained(downloaded).eval()
    own = load_model(str(artifact)).model.eval()
    ids = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, own(ids).logits, rtol=0, atol=1e-4)

    # the card's lmpress snippet runs as written, pointed at the download: packed linears, the dtype generate serves in
    from compressors.kernels import PackedLinear
    from pipelines.serving import serving_dtype

    (snippet,) = [block for block in re.findall(r"```python\n(.*?)```", card, re.S) if "load_for_serving" in block]
    namespace = {}
    exec(snippet.replace('"tester/tiny-rtn4"', repr(str(downloaded))), namespace)  # noqa: S102  (the card's own text)
    served = namespace["loaded"].model
    assert any(isinstance(module, PackedLinear) for module in served.modules())
    with torch.no_grad():
        logits = served(ids).logits
    assert logits.dtype == serving_dtype("auto", "cpu") and logits.isfinite().all()


def test_dry_run_writes_the_upload_folder_without_a_token_or_network(quantized, tmp_path, monkeypatch):
    from pipelines.publish import PublishConfig, publish

    artifact, metrics = quantized
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = tmp_path / "hub-folder"
    result = publish(artifact, PublishConfig(repo_id="tester/x", dry_run=True, metrics=str(metrics)), out)
    assert not result["uploaded"] and (out / "README.md").read_text() == result["card_text"]
    assert {p.name for p in out.iterdir()} == {p.name for p in artifact.iterdir()} | {"README.md"}
    again = publish(artifact, PublishConfig(repo_id="tester/x", dry_run=True, metrics=str(metrics)), tmp_path / "again")
    assert again["card_text"] == result["card_text"]  # the same artifact gives the same card, byte for byte


def test_the_card_claims_vllm_only_where_its_fused_linears_share_a_scheme_and_tags_every_width(quantized, tmp_path):
    """vLLM runs q/k/v and gate/up as one linear each, with one scheme: a plan that gives q_proj
    8 bits and k/v 4, or leaves gate_proj dense beside a 4-bit up_proj, is no vLLM model, though
    every width is one vLLM serves. The tags name every width the plan stores."""
    from pipelines.publish import model_card, read_facts
    from pipelines.stages import QuantizeConfig, quantize

    base = Path(json.loads((quantized[0] / "lineage.json").read_text())["chain"][0]["model"])
    plan = tmp_path / "plan.yaml"
    plan.write_text("'.*q_proj': {bits: 8, group_size: -1}\n")
    cards = {}
    for name, settings in (
        ("whole-layers-apart", {"skip": r"layers\.0\."}),  # every part of layer 0 dense: vLLM serves it
        ("q-apart", {"overrides": str(plan)}),
        ("gate-apart", {"skip": "gate_proj"}),
    ):
        out = quantize(str(base), None, tmp_path / name, QuantizeConfig(method="rtn", bits=4, group_size=32, **settings))
        cards[name] = model_card(read_facts(out), f"tester/{name}")
    assert "vllm serve" in cards["whole-layers-apart"]
    assert "vllm serve" not in cards["q-apart"] and "vllm serve" not in cards["gate-apart"]
    front = cards["q-apart"].split("---")[1]
    assert "- 4-bit" in front and "- 8-bit" in front and "- mixed-precision" in front
    assert f"overrides={plan}" in cards["q-apart"]  # the headline's bits=4 is where no override applies
    assert "- 8-bit" not in cards["gate-apart"].split("---")[1]


def test_publish_refuses_bad_input_and_reports_hub_failures_in_one_line(quantized, tmp_path, monkeypatch):
    from pipelines.publish import PublishConfig, publish
    from pipelines.serving import validate

    artifact, _ = quantized
    in_process_client(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    def refused(folder, message, **settings):
        with pytest.raises(LmpressError, match=message):
            publish(folder, PublishConfig(**{"repo_id": "tester/x", **settings}))

    refused(artifact, "repo id 'tester/bad name!' is not valid on the hub", repo_id="tester/bad name!")
    refused(artifact, "needs its namespace", repo_id="just-a-name")
    refused(artifact / "config.json", "is not a folder")
    unlabeled = tmp_path / "unlabeled"
    unlabeled.mkdir()
    for name in ("config.json", "model.safetensors", "validation.json"):
        os.link(artifact / name, unlabeled / name)
    refused(unlabeled, "has no lmpress lineage manifest .* or pass --force", dry_run=True)
    assert publish(unlabeled, PublishConfig(repo_id="tester/x", dry_run=True, force=True), tmp_path / "forced")["files"]

    failed = tmp_path / "failed"
    failed.mkdir()
    for path in artifact.iterdir():
        os.link(path, failed / path.name) if path.is_file() else None
    report = json.loads((artifact / "validation.json").read_text())
    next(iter(report["layers"].values()))["max_rel_error"]["16"] = 0.5
    (failed / "validation.json").unlink()
    (failed / "validation.json").write_text(json.dumps(report))
    refused(failed, "validation failed: .* off its torch reference by 0.5 .* pass --force", dry_run=True)

    # a report from before kernels listed several sources (one `source` and its `sha256`) still vouches for that file
    older = tmp_path / "older"
    shutil.copytree(artifact, older)
    report = json.loads((artifact / "validation.json").read_text())
    bundled = "kernels/packed_int.py"
    report["kernels"] = {"triton-packed-matmul": {"source": bundled, "sha256": report["kernels"]["triton-packed-matmul"]["sources"][bundled]}}
    (older / "validation.json").write_text(json.dumps(report))
    publish(older, PublishConfig(repo_id="tester/x", dry_run=True), tmp_path / "older-upload")
    assert f"| triton-packed-matmul | `{bundled}` |" in (tmp_path / "older-upload" / "README.md").read_text()
    (older / bundled).write_text("# edited\n")
    refused(older, f"validation failed: {bundled} is missing or is not the triton-packed-matmul source that was validated "
                   f"\\(`lmpress validate {re.escape(str(older))}` checks again", dry_run=True)
    validate(older)  # the fix the refusal names
    publish(older, PublishConfig(repo_id="tester/x", dry_run=True), tmp_path / "revalidated-upload")

    with LocalHub() as hub:
        endpoint = {"endpoint": hub.url, "timeout": 2.0}
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        refused(artifact, "rejected the token \\(401 while checking the token\\)", **endpoint)
        monkeypatch.delenv("HF_TOKEN")
        refused(artifact, "no hub token found: set HF_TOKEN", **endpoint)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        hub.fail["commit"] = 500
        refused(artifact, "answered 500 while uploading and committing.* nothing was committed", **endpoint)
        hub.fail["commit"] = "hang"
        refused(artifact, "did not confirm the commit in time", **endpoint)
        hub.fail.clear()
        hub.fail["create_repo"] = "hang"
        refused(artifact, "did not answer while creating the repository within the timeout", **endpoint)
        assert hub.commits("tester/x") == [] and hub.files("tester/x") == {}  # created, never committed to
        hub.fail.clear()
        hub.fail["whoami"] = 401
        result = run_cli("publish", artifact, "--repo-id", "tester/x", env=hub_env(hub, tmp_path))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "rejected the token" in result.stderr
    assert TOKEN not in result.stdout + result.stderr and "Traceback" not in result.stderr
    assert leftovers(artifact) == []  # no staging folder left beside the artifact


def test_an_asymmetric_card_loads_dequantized_and_claims_vllm_at_4_bits_only(quantized, tmp_path):
    """Asymmetric grids are compressed-tensors with packed zero points: the card's transformers
    snippet asks for the dequantized load (the compressed one rejects them), and vLLM is
    claimed for 4-bit zero points (Marlin's uint4), not 8-bit."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from pipelines.publish import model_card, read_facts
    from pipelines.stages import QuantizeConfig, quantize

    base = Path(json.loads((quantized[0] / "lineage.json").read_text())["chain"][0]["model"])
    cards = {}
    for bits in (4, 8):
        out = quantize(str(base), None, tmp_path / f"asym{bits}", QuantizeConfig(method="rtn", bits=bits, group_size=32, symmetric=False))
        cards[bits] = model_card(read_facts(out), f"tester/asym{bits}")
    snippet = 'from_pretrained("tester/asym4", quantization_config=CompressedTensorsConfig(dequantize=True))'
    assert snippet in cards[4] and "vllm serve tester/asym4" in cards[4] and "vllm serve" not in cards[8]
    AutoModelForCausalLM.from_pretrained(tmp_path / "asym4", quantization_config=CompressedTensorsConfig(dequantize=True))  # as the card says


def test_the_card_shows_lm_eval_scores_beside_the_bases_scored_the_same_way(quantized, tmp_path):
    from pipelines.publish import PublishConfig, publish
    from pipelines.tasks import TasksConfig, evaluate_tasks

    artifact, metrics = quantized
    base = artifact.parent / "tiny"
    folder = tmp_path / "metrics"
    shutil.copytree(metrics, folder)
    ours = evaluate_tasks(str(artifact), folder / "tasks.json", TasksConfig(tasks="pydoc-lastword", limit=4, batch_size=4))
    theirs = evaluate_tasks(str(base), folder / "base-tasks.json", TasksConfig(tasks="pydoc-lastword", limit=4, batch_size=4))
    card = publish(artifact, PublishConfig(repo_id="tester/x", dry_run=True, metrics=str(folder)), tmp_path / "hub")["card_text"]
    assert "## Downstream tasks" in card and "lm-eval 0.4.13 through `lmpress lm-eval` (0-shot, the first 4 examples of each task)" in card
    row = next(line for line in card.splitlines() if line.startswith("| pydoc-lastword (4 examples) | acc |"))
    cells = [f"{e['tasks']['pydoc-lastword']['acc']:.4g} ± {e['tasks']['pydoc-lastword']['acc_stderr']:.4g}" for e in (theirs, ours)]
    assert row == f"| pydoc-lastword (4 examples) | acc | {cells[0]} | {cells[1]} |"
    assert any(line.startswith("| pydoc-lastword (4 examples) | perplexity |") for line in card.splitlines())

    evaluate_tasks(str(base), folder / "base-tasks.json", TasksConfig(tasks="pydoc-lastword", limit=3, batch_size=4))  # not the same examples
    card = publish(artifact, PublishConfig(repo_id="tester/x", dry_run=True, metrics=str(folder)), tmp_path / "hub2")["card_text"]
    assert f"| pydoc-lastword (4 examples) | acc | – | {cells[1]} |" in card
