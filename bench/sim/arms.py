"""The simulator's arms, and the vLLM engine each arm runs in.

Contract: an :class:`ArmSpec` names one connector configuration: no connector
(``kind="none"``), LMCache's own ``LMCacheMPConnector`` (``"stock"``) or ours,
``connector.EventSourcedLMCacheMPConnector`` (``"ours"``), with its
``kv_connector_extra_config`` entries. :func:`standard_arms` is the list
``bench.simulate`` compares. :class:`SimParams` is everything else one run fixes:
the pool, the scheduler's limits, the simulated workers' receipts and failures,
the model's time per step, what the stand-in's lookups answer and the seed.
:func:`build_engine` builds, for one arm and one :class:`SimParams`, the real
vLLM ``Scheduler`` (and with it the ``KVCacheManager``, the ``BlockPool`` and
the connector, made by vLLM's own factory) and the block hasher its requests
need.

Theory of operation: the scheduler needs a model config, not a model, so the
engine runs a config-only tiny Llama (:func:`model_dir`: no weights, no
tokenizer, a long context so multi-turn sessions fit) with ``BLOCK_TOKENS``-token
blocks and prefix caching on. A connector arm points LMCache at a server that
does not exist; while the scheduler is constructed, LMCache's scheduler adapter
class is swapped for :class:`bench.sim.standin.StandInSchedulerAdapter`, which
answers from the :class:`~bench.sim.standin.SimLMCache` given for the arm, and
put back right after. Importing this module quiets vLLM and LMCache (logging,
usage stats, banners, no hub access) before either is imported; the imports
themselves wait for the functions that need them.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import attrs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import logging  # noqa: E402

logging.getLogger("vllm.lazy_offload").setLevel(logging.ERROR)

from bench.sim import standin  # noqa: E402

CHUNK_TOKENS = standin.CHUNK_TOKENS
BLOCK_TOKENS = 32
LAZY = ("lmcache.mp.lazy_offload", True)
_MODEL_DIR: str | None = None


@dataclass(frozen=True)
class ArmSpec:
    name: str
    kind: str  # "none" | "stock" | "ours"
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def lazy(self) -> bool:
        return dict(self.extra).get("lmcache.mp.lazy_offload", False) is True

    @property
    def policy(self) -> str:
        return str(dict(self.extra).get("lmcache.mp.lazy_offload_policy", "EVICTION_AWARE")).upper()


def standard_arms(log_dir: str) -> list[ArmSpec]:
    """Every arm ``bench.simulate`` knows, in its table order; ours write their
    event logs under ``log_dir`` unless the arm turns the log off."""
    ea = ("lmcache.mp.lazy_offload_policy", "EVICTION_AWARE")
    fifo = ("lmcache.mp.lazy_offload_policy", "FIFO")
    log = ("lmcache.mp.lazy_offload_log_dir", log_dir)
    return [
        ArmSpec("none", "none"),
        ArmSpec("stock eager", "stock", (("lmcache.mp.lazy_offload", False),)),
        ArmSpec("stock EA", "stock", (LAZY, ea)),
        ArmSpec("stock FIFO 100/10", "stock", (LAZY, fifo,
                                               ("lmcache.mp.lazy_offload_threshold", 100),
                                               ("lmcache.mp.lazy_offload_select_count", 10))),
        ArmSpec("stock FIFO 20/10", "stock", (LAZY, fifo,
                                              ("lmcache.mp.lazy_offload_threshold", 20),
                                              ("lmcache.mp.lazy_offload_select_count", 10))),
        ArmSpec("ours EA", "ours", (LAZY, ea, log)),
        ArmSpec("ours EA (log off)", "ours", (LAZY, ea, ("lmcache.mp.lazy_offload_log_dir", ""))),
        ArmSpec("ours EA (a read a round)", "ours",
                (LAZY, ea, log, ("lmcache.mp.lazy_offload_cascade_lookahead_blocks", 0))),
        ArmSpec("ours FIFO 20/10", "ours", (LAZY, fifo, log,
                                            ("lmcache.mp.lazy_offload_threshold", 20),
                                            ("lmcache.mp.lazy_offload_select_count", 10))),
    ]


@dataclass(frozen=True)
class SimParams:
    num_gpu_blocks: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 32768
    receipt_delay_steps: int = 1
    receipt_skew_steps: int = 0  # worker w reports after delay + (w % (skew+1))
    world_size: int = 1
    store_failure_rate: float = 0.0
    # Per rank (index = worker rank; missing ranks: 0): extra receipt delay in steps,
    # and the probability that this rank's part of a store fails (it still reports,
    # with the request in its failed set, as LMCache's worker adapter does).
    rank_delay_steps: tuple[int, ...] = ()
    rank_failure_rate: tuple[float, ...] = ()
    max_steps: int = 200000
    seed: int = 0
    # The model's forward per step, spent asleep as vLLM's engine-core thread
    # waits for its executor (the GIL free; no connector code runs then).
    model_ms: float = 0.0
    # MiB of memory the model's stand-in copies at the start of each ``model_ms``
    # (numpy, the GIL free): a forward pass sweeps the scheduler's working set out
    # of the core's caches, a sleep does not; 0: asleep only.
    model_sweep_mib: int = 0
    # "keep": the stand-in answers lookups from what the workers stored; "missing":
    # every lookup answers 0 hit tokens (a server that keeps nothing).
    lookups: str = "keep"
    # The loss attribution (``bench.sim.truth.LossAttribution``): it walks up to
    # 8,192 free blocks each step and keeps a string per offered block, work only
    # the lazy arms' process does, so timing runs leave it off.
    attribute_losses: bool = False


@attrs.frozen(kw_only=True)
class Engine:
    """One arm's vLLM scheduler (its pool and connector inside) and the block
    hasher its requests are made with."""

    scheduler: Any
    block_hasher: Any

    @property
    def pool(self) -> Any:
        return self.scheduler.kv_cache_manager.block_pool

    @property
    def connector(self) -> Any:
        """The scheduler's connector; None for the no-connector arm."""
        return self.scheduler.connector


def model_dir() -> str:
    """A config-only tiny Llama (no weights, no tokenizer): the scheduler needs only
    the config. Long context so multi-turn sessions fit."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        from transformers import LlamaConfig

        d = os.path.join(tempfile.gettempdir(), "bench-sim-tiny-llama")
        if not os.path.exists(os.path.join(d, "config.json")):
            LlamaConfig(vocab_size=32000, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, max_position_embeddings=65536,
                        torch_dtype="float32").save_pretrained(d)
        _MODEL_DIR = d
    return _MODEL_DIR


def transfer_config(arm: ArmSpec, log_dir: str | None) -> Any:
    """The arm's ``KVTransferConfig`` (None for the no-connector arm): ours or stock
    ``LMCacheMPConnector``, pointed at a server that the stand-in replaces."""
    from vllm.config import KVTransferConfig

    if arm.kind == "none":
        return None
    extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 1,
             "lmcache.mp.mq_timeout": 30, **dict(arm.extra)}
    if arm.kind == "ours" and arm.lazy:
        extra.setdefault("lmcache.mp.lazy_offload_log_dir", log_dir or "")
    if arm.kind == "ours":
        module, name = "connector", "EventSourcedLMCacheMPConnector"
    else:
        module = "lmcache.integration.vllm.lmcache_mp_connector"
        name = "LMCacheMPConnector"
    return KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                            kv_role="kv_both", kv_connector_extra_config=extra)


def vllm_configs(arm: ArmSpec, params: SimParams, log_dir: str | None) -> tuple[Any, Any]:
    """``(VllmConfig, KVCacheConfig)``: the tiny model, the pool and the arm."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    p = params
    d = model_dir()
    mc = ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True,
                     max_model_len=p.max_model_len, dtype="float32", seed=0)
    cc = CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True)
    cc.num_gpu_blocks = p.num_gpu_blocks
    sc = SchedulerConfig(max_num_seqs=p.max_num_seqs,
                         max_num_batched_tokens=p.max_num_batched_tokens,
                         max_model_len=p.max_model_len, enable_chunked_prefill=True,
                         is_encoder_decoder=False)
    vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc,
                    kv_transfer_config=transfer_config(arm, log_dir))
    vc.cache_config.num_gpu_blocks = p.num_gpu_blocks
    spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=32,
                             dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=p.num_gpu_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])
    return vc, kcc


def build_engine(arm: ArmSpec, params: SimParams, lm: standin.SimLMCache,
                 log_dir: str | None) -> Engine:
    """vLLM's ``Scheduler`` for the arm, its connector's LMCache server answered by
    ``lm``, and the prefix-cache block hasher (the global none-hash set for it)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc, kcc = vllm_configs(arm, params, log_dir)
    import lmcache.integration.vllm.lmcache_mp_connector as lmc

    standin.CURRENT = lm
    saved = lmc.LMCacheMPSchedulerAdapter
    lmc.LMCacheMPSchedulerAdapter = standin.StandInSchedulerAdapter
    try:
        scheduler = Scheduler(vllm_config=vc, kv_cache_config=kcc,
                              structured_output_manager=StructuredOutputManager(vc),
                              block_size=BLOCK_TOKENS, hash_block_size=BLOCK_TOKENS)
    finally:
        lmc.LMCacheMPSchedulerAdapter = saved
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return Engine(scheduler=scheduler,
                  block_hasher=get_request_block_hasher(BLOCK_TOKENS, hash_fn))
