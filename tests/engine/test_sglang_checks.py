"""The checks `slime-async bench sglang_gpu` runs against real SGLang on a GPU, run here against the
embedded engine (a process, real HTTP) on CPU: a check that cannot pass, or cannot fail, shows up
here before it spends lent GPU time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.sglang_checks import check_generate, check_publish, dead_url, run_checks
from slime_async.launch.process import start_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path):
    server = start_engine(tiny_model_dir, "--max-batch-size", "16")
    yield server.url
    server.stop()


def _trainer(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


async def test_every_check_passes_against_the_embedded_engine(served: str, tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    model = _trainer(tiny_model_dir)
    out = await run_checks(served, model, model.config.vocab_size, dead_url(), tmp_path / "disk")
    failed = {k: v for k, v in out.items() if not v.get("ok")}
    assert not failed, failed
    assert out["generate"]["recorded_vs_raw_mismatches"] == 0
    assert out["generate"]["decode_vs_scoring_max"] < 1e-3  # float32: decode and prefill agree
    assert out["abort"]["finish_reason"]["type"] == "abort" and out["abort"]["client_aborts_sent"] == 1
    assert out["failover"]["retries"] >= 1 and out["failover"]["served_by"] == [served]
    assert out["publish_tensor"]["version_reported"] == "1" and out["publish_disk"]["version_reported"] == "2"
    assert out["publish_disk"]["trainer_vs_server_after_max"] < 1e-3
    # the embedded engine keeps no prefix past its request: re-scored prompts are the new weights' too,
    # in place as after an abort and a flush (real SGLang's radix cache keeps them: README, differences)
    assert out["publish_tensor"]["flushed"] == [served] and out["publish_in_place"]["flushed"] == []
    assert out["publish_in_place"]["reused_prefix_gap_mean"] < 1e-3
    assert out["generate_after_push"]["versions"] == [3]


async def test_the_publish_check_fails_when_the_server_keeps_its_old_weights(served: str, tiny_model_dir: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A push the server acknowledges but does not apply must fail the check (its logprobs stay)."""
    from slime_async.sync.publisher import WeightPublisher

    async def version_only(self, url: str, path: str, body):  # the version moves, the weights do not
        if path == "/update_weights_from_tensor":
            return await original(self, url, "/update_weight_version",
                                  {"new_version": "3", "abort_all_requests": False})
        return await original(self, url, path, body)

    original = WeightPublisher._post
    monkeypatch.setattr(WeightPublisher, "_post", version_only)
    model = _trainer(tiny_model_dir)
    out = await check_publish(served, model, model.config.vocab_size, 3, "tensor", None, seed=5)
    assert out["version_reported"] == "3"
    assert not out["ok"] and out["trainer_vs_server_after_mean"] > 1e-3


async def test_the_generate_check_sees_a_client_that_misreads_logprobs(served: str, tiny_model_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from slime_async.rollout.client import SGLangClient

    parse = SGLangClient._parse

    def shifted(self, raw: bytes):  # type: ignore[no-untyped-def]
        ids, lps, versions, finish, routed = parse(self, raw)
        return ids, lps + 0.5, versions, finish, routed

    monkeypatch.setattr(SGLangClient, "_parse", shifted)
    model = _trainer(tiny_model_dir)
    out = await check_generate(served, model.config.vocab_size, n=2, new_tokens=4)
    assert not out["ok"] and out["recorded_vs_raw_mismatches"] == 2
