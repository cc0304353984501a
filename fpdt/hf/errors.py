"""The error ``fpdt.hf`` raises for what it cannot run as asked, and raising it on every rank at once."""

from __future__ import annotations

import torch
import torch.distributed as dist


class FPDTHFError(ValueError):
    """A Transformers model, input or setting that ``fpdt.hf`` cannot honour; the message names the fix."""


def refuse_on_every_rank(refusal: Exception | None, *, group: dist.ProcessGroup | None,
                         device: torch.device) -> None:
    """Return if no rank of ``group`` (None: the default group) refused this step; else raise
    :class:`FPDTHFError` on every rank of it, so that none goes on into the next collective alone
    (a hang). Every rank calls it once with the error it would raise, or None. A refusing rank
    raises its own message; the others name the refusing (global) ranks and their messages.
    Cost when none refused: one int32 all-reduce on ``device`` and one host read.
    """
    flag = torch.tensor([refusal is not None], dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)          # SUM: how many ranks refused
    if not flag.item():                         # host read: the step goes on only if none did
        return
    messages: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if refusal is None else str(refusal), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(messages)))
    by_message: dict[str, list[int]] = {}
    for r, message in zip(ranks, messages):
        if message is not None:
            by_message.setdefault(message, []).append(r)
    refused = sorted(r for rs in by_message.values() for r in rs)
    who = f"rank{'s' * (len(refused) > 1)} {', '.join(map(str, refused))} of {len(ranks)}"
    if refusal is not None:
        others = {m: rs for m, rs in by_message.items() if m != str(refusal)}
        also = "".join(f"; rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {m}" for m, rs in others.items())
        raise FPDTHFError(f"{refusal} [refused on {who}, every rank stops{also}]") from refusal
    reasons = "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {m}" for m, rs in by_message.items())
    raise FPDTHFError(f"{who} refused this step's inputs, so this rank stops too (its own were fine; going on "
                      f"would leave it waiting in a collective): {reasons}")
