"""Publish an artifact to a hub running on this machine, download it back and reload it: the
whole `lmpress publish` path offline, for trying it out and for the issue's evidence.

    .venv/bin/python scripts/publish_local_hub.py artifacts/quantized --metrics metrics

The hub is tests/hub_server.py (the hub's upload and download API over real HTTP on 127.0.0.1;
it speaks the LFS protocol, not Xet, hence HF_HUB_DISABLE_XET). It prints the files that
arrived with whether each is byte-identical to the artifact's, the card, and the largest logit
difference between stock transformers on the downloaded folder and lmpress's own loader."""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.update(HF_HUB_DISABLE_XET="1", HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")  # before huggingface_hub loads

from hub_server import DEFAULT_TOKENS, LocalHub  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--metrics", default="")
    parser.add_argument("--repo-id", default="tester/published")
    args = parser.parse_args()

    import torch
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM

    from pipelines.models import load_model

    token = next(iter(DEFAULT_TOKENS))
    with tempfile.TemporaryDirectory() as scratch, LocalHub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": token, "HF_HOME": f"{scratch}/hf-home"}
        command = [sys.executable, "-m", "pipelines.cli", "publish", str(args.artifact), "--repo-id", args.repo_id, "--metrics", args.metrics]
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        print(f"$ lmpress publish {args.artifact} --repo-id {args.repo_id} --metrics {args.metrics}  (exit {run.returncode})")
        print(run.stdout + run.stderr)
        if run.returncode:
            sys.exit(run.returncode)
        assert token not in run.stdout + run.stderr
        arrived = hub.files(args.repo_id)
        print(f"commits: {[(c['oid'][:12], c['message']) for c in hub.commits(args.repo_id)]}")
        print("files on the hub (sha256, identical to the artifact's file):")
        for name, data in sorted(arrived.items()):
            local = args.artifact / name
            same = local.is_file() and local.read_bytes() == data
            print(f"  {name:28s} {len(data):>12,} bytes  {hashlib.sha256(data).hexdigest()[:16]}  {'identical' if same else 'new (card)' if name == 'README.md' else 'DIFFERS'}")
        folder = Path(snapshot_download(args.repo_id, endpoint=hub.url, token=token, local_dir=f"{scratch}/download", cache_dir=f"{scratch}/cache"))
        card = (folder / "README.md").read_text()
        ids = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            own = load_model(str(args.artifact)).model.eval()(ids).logits
            try:
                stock = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
                reload = f"stock transformers on the downloaded folder vs lmpress on the artifact: max |logit difference| {(stock - own).abs().max().item():.3g}"
            except Exception as error:  # lmpress-only formats: stock transformers refuses them
                served = load_model(str(folder)).model.eval()(ids).logits
                reload = f"stock transformers cannot open it ({type(error).__name__}); lmpress on the download vs the artifact: max |logit difference| {(served - own).abs().max().item():.3g}"
    print(reload)
    print("\n--- README.md ---\n" + card)


if __name__ == "__main__":
    main()
