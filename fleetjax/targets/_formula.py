"""What a GPT laid out as Megatron-LM lays it out should cost each GPU, by formula.

`Megatron` holds a GPT's shapes and a layout (tensor x pipeline x data parallelism, the
distributed optimizer as ZeRO-1, full recompute, micro-batches of one sequence by default) and
says, from the papers' formulas, what the largest pipeline stage holds in HBM, how many bytes
each mesh axis carries per step, and the step time and MFU of a plain model with no overlap of
communication and computation. Tests, benchmarks and `fleetjax.explain` hold compiled steps
against it (`explain(..., formula=...)`).

Sources: Narayanan et al. 2021 (Megatron-LM at scale: parameters, pipeline bubble, in-flight
micro-batches of 1F1B and of the interleaved schedule), Korthikanti et al. 2022 (a layer's
activation bytes under tensor parallelism), Chowdhery et al. 2022 (PaLM's model flops).
"""

from __future__ import annotations

import dataclasses
import math

from fleetjax.cost import ring_share
from fleetjax.targets._gpus import GpuSpec

__all__ = ["Megatron"]


@dataclasses.dataclass(frozen=True)
class Megatron:
    """A GPT (pre-LayerNorm blocks, learned positions, an untied output layer unless `tied`) of
    `layers` x `hidden` with `heads` heads, `sequence` tokens and `vocab` tokens of vocabulary,
    trained on `global_batch` sequences per step over ``tp x pp x dp`` GPUs: tensor parallel
    over `tp`, pipelined over `pp` (`vpp` model chunks per stage when interleaved), data
    parallel over `dp` replicas with Adam's moments split over them (`zero=1`, Megatron's
    distributed optimizer; `zero=0` keeps them whole), in micro-batches of `micro_batch`
    sequences, bfloat16 compute with float32 master weights, and full recompute of each layer
    (`recompute`).

    `in_flight` is how many micro-batches the first stage keeps the inputs of: Megatron's 1F1B
    keeps ``pp`` (the interleaved schedule ``2 (pp - 1) + (vpp - 1) pp + 1`` chunks); None
    takes Megatron's count.
    """

    layers: int
    hidden: int
    heads: int
    sequence: int
    vocab: int
    global_batch: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    micro_batch: int = 1
    zero: int = 1
    recompute: bool = True
    tied: bool = False
    in_flight: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"Megatron.{field.name} must be a non-negative int, got {value!r}")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"global_batch={self.global_batch} does not split into dp={self.dp} replicas "
                f"of micro-batches of {self.micro_batch}"
            )
        if self.layers % (self.pp * self.vpp):
            raise ValueError(
                f"layers={self.layers} do not split into pp x vpp = {self.pp} x {self.vpp} chunks"
            )

    # -- shapes -----------------------------------------------------------------------------
    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def micro_batches(self) -> int:
        """m: micro-batches per replica per step."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def layer_parameters(self) -> int:
        """One block: q, k, v, the output projection and the MLP (12 h^2) with their biases,
        and two LayerNorms (13 h)."""
        return 12 * self.hidden**2 + 13 * self.hidden

    @property
    def parameters(self) -> int:
        """The whole model: the blocks, token and position embeddings, the final LayerNorm and
        (untied) the output layer."""
        h = self.hidden
        head = 2 * h + (0 if self.tied else self.vocab * h)
        return self.layers * self.layer_parameters + (self.vocab + self.sequence) * h + head

    @property
    def stage_parameters(self) -> float:
        """N_s: the first (largest) pipeline stage's parameters on one GPU: its layers and the
        embeddings, split over tp."""
        embeddings = self.vocab * self.hidden / self.tp + self.sequence * self.hidden
        return self.layers / self.pp * self.layer_parameters / self.tp + embeddings

    @property
    def _activation(self) -> float:
        """Bytes of one micro-batch's [s, b, h] activation in bfloat16."""
        return self.sequence * self.micro_batch * self.hidden * 2

    @property
    def kept_micro_batches(self) -> int:
        """Micro-batch chunks whose layer inputs the first stage keeps (see the class)."""
        if self.in_flight is not None:
            return self.in_flight
        if self.vpp == 1:
            return self.pp
        return 2 * (self.pp - 1) + (self.vpp - 1) * self.pp + 1

    # -- memory -----------------------------------------------------------------------------
    def hbm(self) -> dict[str, float]:
        """The largest stage's bytes on one GPU by part: float32 weights and gradients, Adam's
        moments (over dp), bfloat16 weights, the kept layer inputs, one layer's recompute
        working set ``s b h (10 + 24/t + 5 a s / (h t))`` (Korthikanti et al., table 2) and the
        last stage's float32 logits and their gradient."""
        n, s, b, h, t = self.stage_parameters, self.sequence, self.micro_batch, self.hidden, self.tp
        moments = 8 / self.dp if self.zero else 8
        chunk_layers = self.layers / (self.pp * self.vpp)
        return {
            "weights (fp32)": 4 * n,
            "gradients (fp32)": 4 * n,
            "Adam moments": moments * n,
            "weights (bf16)": 2 * n,
            "kept layer inputs": self.kept_micro_batches * chunk_layers * self._activation,
            "recompute working set": s * b * h * (10 + 24 / t + 5 * self.heads * s / (h * t)),
            "logits": 2 * 4 * s * b * self.vocab / t,
        }

    # -- communication ----------------------------------------------------------------------
    def axis_bytes(self) -> dict[str, float]:
        """Payload bytes each GPU sends per step, by mesh axis: ``mp`` all-reduces of each
        layer's activations (2 forward, 2 backward, 2 recomputed), ``pp`` an activation on and
        a cotangent back per micro-batch and chunk, and the data axes (``data``: dp and
        sharding) a reduce-scatter of the float32 gradients and an all-gather of the updated weights
        (without the distributed optimizer, an all-reduce of the gradients)."""
        per_layer = 6 if self.recompute else 4
        m = self.micro_batches
        return {
            "mp": self.layers / self.pp * m * per_layer * self._activation if self.tp > 1 else 0.0,
            "pp": m * 2 * self._activation * self.vpp if self.pp > 1 else 0.0,
            "data": (2 if self.zero else 1) * 4 * self.stage_parameters if self.dp > 1 else 0.0,
        }

    # -- time -------------------------------------------------------------------------------
    @property
    def model_flops(self) -> float:
        """PaLM's model flops of one step: 6 N per token for the matmuls of the N parameters,
        forward and backward, plus 12 L h s for attention."""
        per_token = 6 * self.parameters + 12 * self.layers * self.hidden * self.sequence
        return per_token * self.global_batch * self.sequence

    @property
    def bubble(self) -> float:
        """The pipeline's idle fraction over its busy time: (pp - 1) / (m vpp)."""
        return (self.pp - 1) / (self.micro_batches * self.vpp)

    def step_seconds(self, gpu: GpuSpec, per_host: int = 8) -> dict[str, float]:
        """One step's time by a plain model, no overlap: the model flops with recompute's
        extra forward (x 4/3) over the bfloat16 peak, stretched by the bubble; then each axis's
        payload at the cost model's ring bytes (`fleetjax.cost.ring_share`: all-reduces over
        mp, sends over pp, over the data axes a reduce-scatter and an all-gather, or without
        the distributed optimizer an all-reduce), over NVLink where its group stays within a
        host of `per_host` GPUs (the axes ordered dp, pp, mp, mp innermost) and over one
        InfiniBand adapter per GPU otherwise."""
        extra = 4 / 3 if self.recompute else 1.0
        compute = self.model_flops * extra / (gpu.peak_bf16_flops * self.gpus) * (1 + self.bubble)
        wire = self.axis_bytes()
        data = "reduce-scatter" if self.zero else "all-reduce"  # all-gather's share is the same
        ring = {
            "mp": ring_share("all-reduce", self.tp) * wire["mp"],
            "pp": ring_share("collective-permute", self.pp) * wire["pp"],
            "data": ring_share(data, self.dp) * wire["data"],
        }
        spans = {"mp": self.tp, "pp": self.tp * self.pp, "data": self.gpus}
        seconds = {"compute": compute}
        for axis, size in ring.items():
            within = spans[axis] <= per_host
            seconds[axis] = size / (gpu.nvlink_bandwidth if within else gpu.network_bandwidth)
        seconds["total"] = math.fsum(seconds.values())
        return seconds

    def mfu(self, gpu: GpuSpec, per_host: int = 8) -> float:
        """Model flops over the plain model's step time and the GPUs' bfloat16 peak."""
        total = self.step_seconds(gpu, per_host)["total"]
        return self.model_flops / (total * self.gpus * gpu.peak_bf16_flops)
