"""Trajectories as padded tensors: the one conversion between the batch's Arrow columns and torch,
and back (in the style of torchtune's ``Trajectory``).

With B trajectories, L = the longest response and T = the longest prompt + response:

    input_ids         (B, T) long     prompt + response, right-padded with ``pad_id``
    attention_mask    (B, T) long     1 on real tokens
    gather_positions  (B, L) long     the position whose logits predict response token t
                                      (padding points at the last real position)
    response_ids      (B, L) long     right-padded with 0
    response_mask     (B, L) float32  the rollout's mask, 0 on padding
    lengths           (B,)   long     response lengths
    fields[name]      (B, L) float32  per-token columns (rollout_logprobs, old_logprobs, ref_logprobs,
                                      entropy, values, advantages, returns, token_level_rewards), 0 on padding

Engines take a ``Trajectories`` and return (B, L) tensors; ``unpad`` turns them back into the
per-row lists the Arrow columns hold. Padding is written once, in ``kfrl.batch.to_torch_padded``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from kfrl.batch import list_column_values, scatter_rows, to_torch_padded

_INT_LISTS = pa.list_(pa.int32())
_FLOAT_LISTS = pa.list_(pa.float32())


def padded(rows, *, floats: bool = False, pad_value=0, side: str = "right") -> torch.Tensor:
    """(len(rows), longest) tensor of python lists (long, or float32 with ``floats``)."""
    array = pa.array(rows, type=_FLOAT_LISTS if floats else _INT_LISTS)
    return to_torch_padded(pa.table({"x": array}), "x", pad_value=pad_value,
                           dtype=torch.float32 if floats else torch.long, side=side)


@dataclass
class Trajectories:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    gather_positions: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    lengths: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_lists(cls, prompts: list[list[int]], responses: list[list[int]],
                   response_masks: list[list[int]] | None = None, *, pad_id: int, device="cpu",
                   fields: dict[str, list[list[float]]] | None = None) -> "Trajectories":
        """From token-id lists (and per-token float lists, each row as long as its response)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        masks = response_masks if response_masks is not None else [[1] * len(r) for r in responses]
        columns = {"prompt_ids": pa.array(prompts, _INT_LISTS), "response_ids": pa.array(responses, _INT_LISTS),
                   "response_mask": pa.array(masks, _INT_LISTS)}
        columns.update({name: pa.array(rows, _FLOAT_LISTS) for name, rows in (fields or {}).items()
                        if rows is not None})
        return cls.from_table(pa.table(columns), pad_id=pad_id, device=device, fields=tuple(fields or ()))

    @classmethod
    def from_table(cls, table: pa.Table, *, pad_id: int, device="cpu",
                   fields: tuple[str, ...] = ()) -> "Trajectories":
        """From a joined batch (``prompt_ids``, ``response_ids``, ``response_mask`` and the per-token
        ``fields`` present in the table). Per-token columns go from Arrow to tensors directly."""
        prompt_values, prompt_lengths = list_column_values(table, "prompt_ids", "Trajectories.from_table")
        response_values, lengths = list_column_values(table, "response_ids", "Trajectories.from_table")
        # Each row's prompt then its response, right-padded, without a round trip through Python lists.
        totals = prompt_lengths + lengths
        sequences = torch.full((len(totals), int(totals.max()) if len(totals) else 0), pad_id, dtype=torch.long)
        scatter_rows(sequences, prompt_values, prompt_lengths)
        scatter_rows(sequences, response_values, lengths, prompt_lengths)
        prompt_lengths, lengths = torch.from_numpy(prompt_lengths), torch.from_numpy(lengths)
        width = max(1, int(lengths.max()) if len(lengths) else 1)

        def per_token(name: str, dtype) -> torch.Tensor:
            out = to_torch_padded(table, name, dtype=dtype)
            return torch.nn.functional.pad(out, (0, width - out.shape[1]))

        positions = prompt_lengths[:, None] - 1 + torch.arange(width)
        gather_positions = torch.minimum(positions, (prompt_lengths + lengths - 1)[:, None])
        attention_mask = (torch.arange(sequences.shape[1]) < (prompt_lengths + lengths)[:, None]).long()
        extra = {name: per_token(name, torch.float32) for name in fields if name in table.column_names}
        return cls(sequences, attention_mask, gather_positions, per_token("response_ids", torch.long),
                   per_token("response_mask", torch.float32), lengths, extra).to(device)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> "Trajectories":
        return Trajectories(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.gather_positions,
                                                      self.response_ids, self.response_mask, self.lengths)),
                            {k: v.to(device) for k, v in self.fields.items()})

    def select(self, rows) -> "Trajectories":
        return Trajectories(self.input_ids[rows], self.attention_mask[rows], self.gather_positions[rows],
                            self.response_ids[rows], self.response_mask[rows], self.lengths[rows],
                            {k: v[rows] for k, v in self.fields.items()})

    def trimmed(self) -> "Trajectories":
        """The same trajectories without the trailing columns that are padding in every row: a
        micro-batch of similar lengths then computes no padding tokens (``use_dynamic_bsz``)."""
        width = max(1, int(self.attention_mask.sum(-1).max())) if len(self) else 1
        length = max(1, int(self.lengths.max())) if len(self) else 1
        return Trajectories(self.input_ids[:, :width], self.attention_mask[:, :width],
                            self.gather_positions[:, :length], self.response_ids[:, :length],
                            self.response_mask[:, :length], self.lengths,
                            {k: v[:, :length] for k, v in self.fields.items()})

    def get(self, name: str) -> torch.Tensor | None:
        return self.fields.get(name)

    def unpad(self, tensor: torch.Tensor) -> list[list[float]]:
        """(B, L) → one list per trajectory, as long as its response (what the Arrow columns hold)."""
        return [row.tolist() for row in self.unpad_vectors(tensor)]

    def unpad_vectors(self, tensor: torch.Tensor) -> list[np.ndarray]:
        """``unpad`` as float32 numpy vectors (views of one copy; numpy pickles a view's own values only),
        which ``batch.make_table`` turns into a list column in one concatenation, not value by value."""
        values = tensor.detach().float().cpu().numpy()
        return [values[i, :n] for i, n in enumerate(self.lengths.tolist())]
