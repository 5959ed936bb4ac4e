"""torchtitan 0.2 train spec for benchmarks/train_titan_moe.py: a Qwen3 MoE whose experts have
the shape of Qwen3-30B-A3B's or of DeepSeek-V3's (one rank's 32 experts), on synthetic data.

Imported by torchtitan's trainer through ``--experimental.custom_import
benchmarks.titan_moe_spec`` (run from the repository root). Importing it registers

* the train spec ``"compileops_qwen3_moe"``: torchtitan's own Qwen3 model, parallelize
  function, optimizers (with its MoE load balancing), LR schedule and loss; a synthetic
  dataloader (no tokenizer, no download);
* compileops' converters ``"compileops_moe"`` and ``"compileops_moe_fp8"`` (importing the
  torchtitan integration);
* ``"titan_float8_experts"``: torchtitan's fp8 MoE recipe as torchtitan 0.3 applies it
  (``Float8GroupedExpertsConverter``: torchao's ``Float8TrainingOpConfig`` on every
  ``GroupedExperts``, token groups padded to 16), for torchao releases without the
  ``MoETrainingConfig`` that 0.2.2's own ``quantize.grouped_mm.float8`` imports (torchao 0.18
  has only the newer API).

Flavors (``--model.flavor``): ``"qwen3-30b-a3b-experts"`` (width 2048, 128 experts of hidden
768, top-8, 32 heads of 128, 4 KV heads) and ``"dsv3-experts"`` (width 7168, 32 experts of
hidden 2048, top-8: the experts one of 8 expert-parallel ranks holds in DeepSeek-V3; 56 heads
of 128, 8 KV heads). ``COMPILEOPS_TITAN_LAYERS`` sets the number of layers (default 4 and 2),
``COMPILEOPS_TITAN_VOCAB`` the vocabulary (default 32000: the benchmark is about the experts).

The data: token t+1 = (token t + 7 + noise) mod vocab, noise in {0..3} from a seeded
generator: a sequence the model can learn, so the loss curves say something. The optimizer
builder is torchtitan's with its MoE load balancing (as DeepSeek-V3's spec; Qwen3's own spec
of 0.2.2 uses the plain one).
"""
from __future__ import annotations

import os

import torch
from torch.utils.data import IterableDataset

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from torchtitan.protocols.model_converter import register_model_converter

import compileops.integrations.torchtitan  # noqa: F401  (registers the converters)

NAME = "compileops_qwen3_moe"
VOCAB = int(os.environ.get("COMPILEOPS_TITAN_VOCAB", "32000"))


def _layers(default: int) -> int:
    return int(os.environ.get("COMPILEOPS_TITAN_LAYERS", default))


def _args(*, dim, n_heads, n_kv_heads, experts, hidden, layers) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        vocab_size=VOCAB, max_seq_len=8192, head_dim=128, dim=dim, n_layers=layers,
        n_heads=n_heads, n_kv_heads=n_kv_heads, qk_norm=True, hidden_dim=3 * dim,
        rope_theta=1000000, moe_enabled=True, moe_inter_dim=hidden,
        moe_args=MoEArgs(num_experts=experts, num_shared_experts=0, top_k=8,
                         score_func="softmax", route_norm=True, route_scale=1.0,
                         score_before_experts=False))


FLAVORS = {
    "qwen3-30b-a3b-experts": _args(dim=2048, n_heads=32, n_kv_heads=4, experts=128,
                                   hidden=768, layers=_layers(4)),
    "dsv3-experts": _args(dim=7168, n_heads=56, n_kv_heads=8, experts=32, hidden=2048,
                          layers=_layers(2)),
}


class SyntheticTokens(IterableDataset):
    """Endless ``({"input": [seq_len]}, labels [seq_len])`` samples of the sequence above."""

    def __init__(self, seq_len: int, seed: int):
        self.seq_len, self.seed = seq_len, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        while True:
            start = torch.randint(0, VOCAB, (1,), generator=g)
            steps = 7 + torch.randint(0, 4, (self.seq_len,), generator=g)
            tokens = torch.cat([start, start + torch.cumsum(steps, 0)]) % VOCAB
            yield {"input": tokens[:-1]}, tokens[1:]

    # torchtitan's dataloader checkpoints its datasets' state
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def build_synthetic_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config,
                               **kwargs) -> ParallelAwareDataloader:
    dataset = SyntheticTokens(job_config.training.seq_len, seed=1234 + dp_rank)
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=job_config.training.local_batch_size)


class TitanFloat8Experts:
    """torchtitan 0.3's fp8 MoE recipe on torchtitan 0.2's ``GroupedExperts`` (torchao's
    rowwise fp8 grouped GEMMs for the experts' three products)."""

    def __init__(self, job_config, parallel_dims):
        from torchtitan.models.moe.utils import set_token_group_alignment_size_m

        set_token_group_alignment_size_m(16)  # fp8: 16-byte aligned token groups

    def convert(self, model: torch.nn.Module) -> None:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization.quant_api import quantize_
        from torchtitan.models.moe.moe import GroupedExperts

        quantize_(model, config=Float8TrainingOpConfig(),
                  filter_fn=lambda module, fqn: isinstance(module, GroupedExperts))

    def post_optimizer_hook(self, model) -> None:
        pass


register_model_converter(TitanFloat8Experts, "titan_float8_experts")

register_train_spec(NAME, TrainSpec(
    model_cls=Qwen3Model,
    model_args=FLAVORS,
    parallelize_fn=parallelize_qwen3,
    pipelining_fn=None,
    build_optimizers_fn=build_optimizers_with_moe_load_balancing,
    build_lr_schedulers_fn=build_lr_schedulers,
    build_dataloader_fn=build_synthetic_dataloader,
    build_tokenizer_fn=None,
    build_loss_fn=build_cross_entropy_loss,
))
