"""The example GPT (examples/gpt.py) at test size, with eight heads so that tensor parallelism
can take all 8 devices."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
from gpt import GPTConfig, make_gpt

EIGHT_HEADS = GPTConfig(
    vocab_size=64,
    max_position_embeddings=8,
    hidden_size=32,
    num_attention_heads=8,
    num_hidden_layers=2,
    intermediate_size=64,
    initializer_range=0.2,
)

__all__ = ["EIGHT_HEADS", "GPTConfig", "make_gpt"]
