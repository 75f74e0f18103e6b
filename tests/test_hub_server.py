"""LocalHub (tests/hub_server.py) driven by the real huggingface_hub client, in-process, over HTTP."""

import os
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, HfApi, constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError

from hub_server import LFS_SIZE_THRESHOLD, LocalHub

TOKEN = "hf_lmpress_test_token"  # LocalHub's default token, user "tester"


@pytest.fixture
def hub(monkeypatch):
    # These constants are read from the environment once, at import; the client checks them on every call.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the test runner exports HF_HUB_OFFLINE=1
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # upload through LFS "basic", which LocalHub speaks
    # With telemetry on, the user-agent header asks huggingface.co itself for a list of agent harnesses.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    with LocalHub() as hub:
        yield hub


def test_folder_round_trip_through_lfs_and_back(hub, tmp_path):
    local = {
        "model.safetensors": os.urandom(LFS_SIZE_THRESHOLD + 4096),  # binary and over 10 MiB: LFS
        "config.json": b'{"model_type": "llama", "hidden_size": 64}\n',
        "README.md": b"---\nlicense: apache-2.0\n---\n# tiny\n",  # also sent to /api/validate-yaml
        "tokenizer/tokenizer_config.json": b'{"model_max_length": 128}\n',
    }
    folder = tmp_path / "model"
    for path, data in local.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)

    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo("tester/tiny", private=True, exist_ok=True)
    api.create_repo("tester/tiny", private=True, exist_ok=True)  # 409, which exist_ok accepts
    info = api.create_commit(
        "tester/tiny",
        operations=[CommitOperationAdd(path, folder / path) for path in local],
        commit_message="Upload tiny",
    )

    assert hub.files("tester/tiny") == local
    (commit,) = hub.commits("tester/tiny")
    assert (commit["message"], commit["oid"], commit["revision"]) == ("Upload tiny", info.oid, "main")
    assert hub.repos() == {"tester/tiny": {"private": True, "branches": ["main"]}}
    puts = [path for method, path in hub.requests if method == "PUT"]
    assert len(puts) == 1 and puts[0].startswith("/lfs-upload/")  # only the weights went through LFS

    downloaded = Path(snapshot_download(
        "tester/tiny", revision="main", endpoint=hub.url, token=TOKEN,
        local_dir=tmp_path / "download", cache_dir=tmp_path / "cache",
    ))
    files = [p for p in downloaded.rglob("*") if p.is_file() and ".cache" not in p.relative_to(downloaded).parts]
    assert {p.relative_to(downloaded).as_posix(): p.read_bytes() for p in files} == local


def test_unknown_token_gets_401(hub):
    with pytest.raises(HfHubHTTPError) as caught:
        HfApi(endpoint=hub.url, token="hf_not_a_known_token").whoami()
    assert caught.value.response.status_code == 401
    assert HfApi(endpoint=hub.url, token=TOKEN).whoami()["name"] == "tester"


def test_failed_commit_leaves_the_branch_untouched(hub):
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo("tester/tiny")
    weights = os.urandom(4096)  # binary: LFS even though small

    def operations():
        return [CommitOperationAdd("model.safetensors", weights), CommitOperationAdd("config.json", b"{}\n")]

    hub.fail["commit"] = 500  # create_commit does not retry the commit call itself, so this fails at once
    with pytest.raises(HfHubHTTPError) as caught:
        api.create_commit("tester/tiny", operations=operations(), commit_message="Upload tiny")
    assert caught.value.response.status_code == 500
    assert ("POST", "/api/models/tester/tiny/commit/main") in hub.requests  # it got that far: LFS upload done
    assert hub.commits("tester/tiny") == [] and hub.files("tester/tiny") == {}

    hub.fail.clear()  # a retry commits, and does not upload the weights again
    api.create_commit("tester/tiny", operations=operations(), commit_message="Upload tiny")
    assert [c["message"] for c in hub.commits("tester/tiny")] == ["Upload tiny"]
    assert hub.files("tester/tiny") == {"model.safetensors": weights, "config.json": b"{}\n"}
    assert sum(method == "PUT" for method, _ in hub.requests) == 1
