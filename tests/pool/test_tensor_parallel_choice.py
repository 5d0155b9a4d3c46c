"""`[pool] tensor_parallel_size`: the vLLM engine over ranks as a pool's engine, and the settings refused around it.

What the pool builds from the table is checked without starting vLLM (the engine itself runs in
tests/engines/test_vllm_ranks.py): above 1 with engine "vllm", the pool's engine settings are those of
`VLLMRanksEngine` with that many ranks; another engine, or a size below 1, is refused naming the key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deltamesh.config import ConfigError, load_config
from deltamesh.mesh.engines.vllm_engine import VLLMEngineConfig
from deltamesh.mesh.engines.vllm_ranks import VLLMRanksConfig
from deltamesh.mesh.pool.config import PoolConfig
from deltamesh.mesh.pool.engine_setup import vllm_config

TABLE = """[pool]
name = "eu-tp"
broker = "http://127.0.0.1:8800"
engine = "{engine}"
tensor_parallel_size = {tp}

[pool.sync]
gateways = ["http://127.0.0.1:8700"]
token = "t"
trusted_keys = ["trainer.pub"]

[[pool.models]]
model_id = "tiny"
model_path = "/models/tiny"
"""


def pool(tmp_path: Path, engine: str, tp: int) -> PoolConfig:
    path = tmp_path / "pool.toml"
    path.write_text(TABLE.format(engine=engine, tp=tp))
    return load_config(PoolConfig, path, section="pool")


def test_a_vllm_pool_over_two_ranks_builds_the_ranks_engine(tmp_path: Path) -> None:
    cfg = pool(tmp_path, "vllm", 2)
    built = vllm_config(cfg.models[0], max_batch=cfg.max_batch, tensor_parallel_size=cfg.tensor_parallel_size)
    assert isinstance(built, VLLMRanksConfig) and built.tensor_parallel_size == 2
    assert built.engine_args["tensor_parallel_size"] == 2 and built.model_dir == "/models/tiny"
    single = vllm_config(pool(tmp_path, "vllm", 1).models[0])
    assert type(single) is VLLMEngineConfig


@pytest.mark.parametrize("engine, tp, needle", [
    ("transformers", 2, 'tensor_parallel_size 2 needs engine "vllm"'),
    ("sglang", 4, 'tensor_parallel_size 4 needs engine "vllm"'),
    ("vllm", 0, "tensor_parallel_size must be >= 1"),
])
def test_a_tensor_parallel_size_the_engine_cannot_take_is_refused(tmp_path: Path, engine: str, tp: int,
                                                                  needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        pool(tmp_path, engine, tp)
