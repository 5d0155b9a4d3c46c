"""The trainer loop and `deltamesh train`: its config, padding batches for ranks, and real runs.

The config and padding tests run in this process. The last two run everything as processes: a
broker, an origin gateway, a pool following it and `deltamesh train`, killed with SIGKILL mid-run and
restarted (its unacknowledged batch is served again); then two policies sharing one broker, one of
them sharded over two torchrun ranks, the other stopped with SIGTERM. The loop's start against a
gateway and its publishing client are tested in test_publish.py.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from deltamesh.delta import dir_manifest
from deltamesh.trainer.loop import pad_rows
from deltamesh.trainer.step import TrainState, build_optimizer, train_step

MODEL = "policy"


def test_one_trainer_table_holds_the_core_and_the_loop_settings(tmp_path):
    from deltamesh.config import ConfigError, load_config
    from deltamesh.trainer.loop_config import TrainLoopConfig

    path = tmp_path / "mesh.toml"
    path.write_text('[trainer]\nmodel_id = "solver"\nbroker = "http://b:1/"\ngateway = "http://g:2"\nmodel = "m"\n'
                    'key = "k"\nbatch_size = 32\n[trainer.optim]\nlr = 2e-6\n[gateway]\nregion = "x"\n')
    cfg = load_config(TrainLoopConfig, path, section="trainer", overrides={"checkpoint.dir": "ck", "max_steps": 5})
    assert (cfg.model_id, cfg.optim.lr, cfg.checkpoint.dir) == ("solver", 2e-6, Path("ck"))
    assert (cfg.broker, cfg.batch_size, cfg.max_steps) == ("http://b:1", 32, 5)
    for bad in ({"broker": "b:1"}, {"batch_size": 0}, {"device": "tpu"}, {"key": ""}, {"optim.lr": 0.0}):
        with pytest.raises(ConfigError):
            load_config(TrainLoopConfig, path, section="trainer", overrides=bad)
    # The loop's settings once had a table of their own: such a file says where they went.
    old = tmp_path / "old.toml"
    old.write_text('[trainer]\nmodel_id = "solver"\n[train]\nbroker = "http://b:1"\n')
    with pytest.raises(ConfigError, match=r"\[train\] moved to \[trainer\]"):
        load_config(TrainLoopConfig, old, section="trainer")


@pytest.mark.slow
def test_padding_rows_for_ranks_leaves_the_step_unchanged(tiny):
    """Rows added so a batch splits evenly over ranks carry no loss and change no gradient."""
    cfg = tiny.trainer_config()
    results = []
    for pad in (False, True):
        model = tiny.tiny_model()
        batch = tiny.fixed_batches(model, 1, rows=6)[0]
        if pad:
            batch = pad_rows(batch, 4)
            assert batch.rows == 8 and not batch.loss_mask[6:].any()
        state = TrainState(model, build_optimizer(model, cfg.optim))
        metrics = train_step(state, batch, cfg)
        results.append((metrics["loss"], {n: p.detach().clone() for n, p in model.named_parameters()}))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for name, value in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], value, rtol=1e-5, atol=1e-7)


# -- real processes -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_lm():
    """The tiny model's directory and the model itself (fp32), to score made-up trajectories."""
    from deltamesh.mesh.demo.models import tiny_model_dir
    from deltamesh.trainer.models import load_causal_lm

    path = tiny_model_dir()
    return path, load_causal_lm(path, dtype=torch.float32)


@pytest.fixture
def real_mesh(tmp_path: Path, key_files, tiny_lm, mesh):
    _, private, public = key_files
    m = mesh.Mesh(tmp_path, public, private, tiny_lm[0])
    yield m
    m.close()


def feed(mesh, broker: str, model, model_id: str, steps: int, *, seed: int, version: int = 0,
         rewards: tuple[float, ...] = (0.0, 1.0)) -> None:
    """Enough groups for `steps` batches of two groups (through the helpers of loop_mesh.py, `mesh`)."""
    mesh.submit(broker, mesh.make_trajectories(model, model_id, 2 * steps, version=version, seed=seed,
                                               rewards=rewards))


@pytest.mark.slow
def test_trainer_killed_and_restarted_continues_the_delta_chain(real_mesh, tiny_lm, tmp_path, mesh):
    """SIGKILL mid-run, restart: versions continue after the gateway's head as deltas on the previous
    version, the pool that follows the gateway all along never needs a second full snapshot, and the
    batch trained after the last checkpoint is served again, so no sample is lost."""
    model = tiny_lm[1]
    batch = 2 * mesh.GROUP  # samples: two groups per step
    broker = real_mesh.broker([MODEL])
    gateway = real_mesh.gateway()
    pool_dir = real_mesh.pool("p1", gateway, MODEL)
    metrics_file = tmp_path / "steps.jsonl"
    args = ["--batch-size", str(batch), "--max-steps", "9", "--checkpoint.dir", str(tmp_path / "ckpt"),
            "--checkpoint.every", "2", "--full-every", "4", "--optim.lr", "1e-5", "--poll-s", "1",
            "--metrics-file", str(metrics_file)]
    # Everything boots side by side; the trainer retries the gateway and the broker until they answer.
    first = real_mesh.trainer("trainer-1", broker=broker, gateway=gateway, model_id=MODEL, args=args)
    real_mesh.ready()
    feed(mesh, broker, model, MODEL, 5, seed=1)

    def broker_version() -> int:
        return mesh.get_json(f"{broker}/v1/status")["models"][MODEL]["version"]

    # Five batches trained and v5 published and reported: the trainer now waits for data. Kill it.
    mesh.wait_until(lambda: broker_version() == 5 and len(mesh.read_records(metrics_file)) == 5, 120,
                    "v5 at the broker and in the step records", [first])
    first.signal(signal.SIGKILL)
    first.wait(10)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("v")) == [
        "v0000000002", "v0000000004"]

    # Batches 1-4 were acknowledged after the checkpoints at v2 and v4. Batch 5 was trained after the
    # last checkpoint, so its update died with the trainer: the broker serves it again to the restarted
    # trainer (which holds nothing), and four new batches make the five steps left.
    feed(mesh, broker, model, MODEL, 4, seed=2, version=5)
    second = real_mesh.trainer("trainer-2", broker=broker, gateway=gateway, model_id=MODEL, args=args)
    assert second.wait(120) == 0, second.tail()
    assert "rebuilt by its delta chain from the trainer's v4" in second.tail(20000)

    versions = mesh.gateway_versions(gateway, MODEL)
    assert sorted(versions) == list(range(11))
    for v in range(1, 11):  # steps 5..9 after the restart made versions 6..10
        assert versions[v]["delta"]["base_version"] == v - 1, versions[v]
        assert versions[v]["delta"]["complete"]
    assert sorted(v for v, kinds in versions.items() if "full" in kinds) == [0, 4, 8]
    assert broker_version() == 10

    records = mesh.read_records(metrics_file)
    assert [(r["step"], r["version"]) for r in records] == [(s, s) for s in range(1, 6)] + [
        (s, s + 1) for s in range(5, 10)]
    assert all(r["published"] for r in records)
    assert all(0.0 <= r["wait_fraction"] <= 1.0 and r["train_seconds"] > 0 for r in records)
    lost, again = records[4], records[5]  # step 5 before the kill, and after the restart
    assert again["batch_id"] != lost["batch_id"] and again["reward_mean"] == lost["reward_mean"]
    served = mesh.get_text(f"{broker}/metrics")
    requeued = {"model_id": MODEL, "reason": "not_held"}
    assert mesh.metric(served, "deltamesh_broker_batches_requeued_total", requeued) == 1
    assert mesh.metric(served, "deltamesh_broker_batch_acks_total", {"model_id": MODEL, "outcome": "acked"}) == 9
    status = mesh.get_json(f"{broker}/v1/status")["models"][MODEL]
    assert (status["fresh_groups"], status["unacked_batches"]) == (0, 0)  # every sample trained and acknowledged

    mesh.wait_until(lambda: dir_manifest(pool_dir).version == 10, 60, "the pool at v10", real_mesh.procs[:3])
    served = mesh.get_text(f"{gateway}/metrics")
    full_to_pools = mesh.metric(served, "deltamesh_gateway_bytes_out_total", {"kind": "full", "peer_role": "pool"})
    fulls = {versions[v]["full"]["payload_bytes"] for v in (0, 4, 8)}
    assert full_to_pools in fulls  # its first pull only; every later version came as deltas
    # The pool holds exactly the trainer's last weights (apply checked every tensor against the manifest).
    assert dir_manifest(pool_dir).weights_hash == versions[10]["delta"]["weights_hash"]


@pytest.mark.slow
def test_a_trainer_killed_after_a_checkpoint_whose_ack_was_lost_trains_nothing_twice(real_mesh, tiny_lm, tmp_path,
                                                                                   mesh):
    """The window the chaos soak's exactly-once invariant (benchmarks/soak.py) covers: a trainer killed
    after it wrote a checkpoint and before that checkpoint's acknowledgement reached the broker was, once
    restarted, served the batch it had trained again, and trained on those samples a second time. The
    checkpoint now names its batches and the restarted trainer acknowledges them before it polls."""
    model = tiny_lm[1]
    broker = real_mesh.broker([MODEL])
    gateway = real_mesh.gateway()
    real_mesh.ready()
    lossy = mesh.AckDropper(broker)
    try:
        metrics_file = tmp_path / "steps.jsonl"
        args = ["--batch-size", str(2 * mesh.GROUP), "--max-steps", "2", "--checkpoint.dir", str(tmp_path / "ckpt"),
                "--checkpoint.every", "1", "--poll-s", "1", "--metrics-file", str(metrics_file)]
        first = real_mesh.trainer("trainer-1", broker=lossy.url, gateway=gateway, model_id=MODEL, args=args)
        feed(mesh, broker, model, MODEL, 1, seed=1)
        mesh.wait_until(lambda: len(mesh.read_records(metrics_file)) == 1 and (tmp_path / "ckpt" / "v0000000001").exists()
                        and lossy.dropped, 180, "step 1 checkpointed, its acknowledgement lost", [first])
        first.signal(signal.SIGKILL)
        first.wait(10)
    finally:
        lossy.close()
    feed(mesh, broker, model, MODEL, 1, seed=2, version=1)
    second = real_mesh.trainer("trainer-2", broker=broker, gateway=gateway, model_id=MODEL, args=args)
    assert second.wait(180) == 0, second.tail()
    steps = mesh.read_records(metrics_file)
    assert [r["step"] for r in steps] == [1, 2]
    assert not set(steps[0]["ids"]) & set(steps[1]["ids"]), "step 2 trained on step 1's trajectories again"
    served = mesh.get_text(f"{broker}/metrics")
    assert mesh.metric(served, "deltamesh_broker_batches_requeued_total", {"model_id": MODEL, "reason": "not_held"}) == 0
    status = mesh.get_json(f"{broker}/v1/status")["models"][MODEL]
    assert (status["fresh_groups"], status["unacked_batches"]) == (0, 0)


@pytest.mark.slow
def test_two_policies_share_one_broker_each_with_its_own_stream(real_mesh, tiny_lm, tmp_path, mesh):
    """A Solver trainer (one process, stopped with SIGTERM) and a Verifier trainer (two FSDP ranks
    under torchrun, batches of one group of three padded to split over them) consume only their own
    batches from one broker and publish their own delta chains through one gateway. Both measure the
    trainer-side mismatch on their first step only (the tokens are tagged v0), near zero since the
    behaviour logprobs are the model's own, and the Solver serves it at `--metrics-listen`."""
    model = tiny_lm[1]
    batch = 2 * mesh.GROUP  # samples: two groups per step
    broker = real_mesh.broker(["solver", "verifier"])
    gateway = real_mesh.gateway()
    common = ["--optim.lr", "1e-5", "--poll-s", "1", "--full-every", "0"]
    solver_metrics = f"http://127.0.0.1:{mesh.free_port()}"
    solver = real_mesh.trainer(
        "solver", broker=broker, gateway=gateway, model_id="solver",
        args=[*common, "--batch-size", str(batch), "--checkpoint.dir", str(tmp_path / "ckpt-solver"),
              "--checkpoint.every", "100", "--metrics-file", str(tmp_path / "solver.jsonl"),
              "--metrics-listen", solver_metrics.removeprefix("http://")])
    verifier = real_mesh.trainer(
        "verifier", broker=broker, gateway=gateway, model_id="verifier", ranks=2,
        args=[*common, "--batch-size", "3", "--max-steps", "2", "--checkpoint.dir", str(tmp_path / "ckpt-verifier"),
              "--checkpoint.every", "1", "--metrics-file", str(tmp_path / "verifier.jsonl")])

    real_mesh.ready()
    # Rewards tell the policies' data apart: solver batch means are k/8, verifier ones lie in [0.01, 0.02].
    feed(mesh, broker, model, "solver", 3, seed=3, rewards=(0.0, 1.0))
    mesh.submit(broker, mesh.make_trajectories(model, "verifier", 2, version=0, seed=4, rewards=(0.01, 0.02),
                                               group_size=3))

    def at_broker(model_id: str) -> int:
        return mesh.get_json(f"{broker}/v1/status")["models"][model_id]["version"]

    mesh.wait_until(lambda: at_broker("solver") == 3, 120, "solver v3 at the broker", [solver])
    served = mesh.get_text(f"{solver_metrics}/metrics")
    assert "deltamesh_build_info" in served
    (counted,) = [line for line in served.splitlines() if line.startswith("deltamesh_trainer_mismatch_tokens_total{")]
    assert 'model_id="solver"' in counted and float(counted.rsplit(" ", 1)[1]) > 0
    assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in served.splitlines()
               if line.startswith("deltamesh_trainer_mismatch_flagged{"))
    solver.signal(signal.SIGTERM)
    assert solver.wait(30) == 0, solver.tail()
    assert verifier.wait(180) == 0, verifier.tail()

    for model_id, last in (("solver", 3), ("verifier", 2)):
        versions = mesh.gateway_versions(gateway, model_id)
        assert sorted(versions) == list(range(last + 1))
        assert [versions[v]["delta"]["base_version"] for v in range(1, last + 1)] == list(range(last))
        assert at_broker(model_id) == last
    # The sharded trainer published in parts (each rank its rows: format 4, a span per piece), the
    # single process whole (format 3).
    for model_id, parts in (("solver", False), ("verifier", True)):
        envelope = mesh.get_json(f"{gateway}/v1/models/{model_id}/versions/1/delta/manifest")
        body = json.loads(envelope["body"])
        assert body["format_version"] == (4 if parts else 3)
        assert all(len(p) == (4 if parts else 3) for p in body["pieces"])
    solver_steps = mesh.read_records(tmp_path / "solver.jsonl")
    verifier_steps = mesh.read_records(tmp_path / "verifier.jsonl")
    assert [r["version"] for r in solver_steps] == [1, 2, 3]
    assert [r["version"] for r in verifier_steps] == [1, 2]
    assert all(r["samples"] == batch and r["reward_mean"] * 8 == round(r["reward_mean"] * 8) for r in solver_steps)
    assert all(r["samples"] == 3 and 0.01 <= r["reward_mean"] <= 0.02 + 1e-6 for r in verifier_steps)
    for steps in (solver_steps, verifier_steps):
        # Only the first step trained at v0, the version its tokens were generated at; the FSDP ranks'
        # rows (the padding row dropped) come back together.
        assert [r["mismatch"]["version"] for r in steps] == list(range(len(steps)))
        (first,) = steps[0]["mismatch"]["pools"].values()
        assert first["tokens"] > 0 and first["abs"] < 1e-3 and first["k3"] < 1e-5 and not first["flagged"]
        assert all(r["mismatch"]["pools"] == {} for r in steps[1:])
    # The clean stop wrote a final checkpoint; the sharded trainer checkpointed every version.
    assert sorted(p.name for p in (tmp_path / "ckpt-solver").iterdir()) == ["v0000000003"]
    assert sorted(p.name for p in (tmp_path / "ckpt-verifier").iterdir()) == ["v0000000001", "v0000000002"]
    status = mesh.get_json(f"{broker}/v1/status")["models"]
    assert all(status[m]["fresh_groups"] == 0 and status[m]["unacked_batches"] == 0 for m in ("solver", "verifier"))
