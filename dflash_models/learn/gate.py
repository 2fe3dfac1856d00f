"""The gate: a candidate drafter is promoted only if it beats the serving one where it matters and loses little
where it used to be good.

Acceptance is measured offline as the server would see it, on sequences whose tokens are the target's own choices
(captured responses: the target's greedy or sampled tokens; the original mix: its greedy responses): decoding is
replayed from the first response token, each step drafting a block from the anchor (the last committed token) with
the context features of the tokens before it; the step commits the leading drafts that equal the target's tokens
plus one (chain verification at the drafter's full block). Tokens per step = committed tokens / steps; the
per-position conditional acceptance p_j = accepted at j / tried at j. Greedy and sampled requests are reported as
separate classes (a sampled response's tokens are one draw of the target: the figure is what a greedy draft of it
accepts, the chain sampler's lower bound).

The gain must also be real, not the luck of a small slice: the held-out sequences are resampled (a paired bootstrap:
both drafters on the same resampled sequences) and the candidate is promoted only if its tokens per step beat the
serving drafter's in at least `confidence` of the resamples. A small slice's figure moves with the few requests it
holds, so the margin alone would promote noise.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

MAX_ANCHORS = 256  # per sequence: longer responses are measured on their first MAX_ANCHORS positions
MAX_SEQUENCES = 256  # held-out sequences a gate measures (the newest): its cost stays flat as the store grows


@dataclass
class Acceptance:
    steps: int = 0
    tokens: int = 0
    accepted_by_pos: list[int] = field(default_factory=list)
    tried_by_pos: list[int] = field(default_factory=list)
    per_sequence: list[tuple[int, int]] = field(default_factory=list)  # (tokens, steps) of each sequence, in order

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else float("nan")

    def p(self) -> list[float]:
        return [round(a / t, 3) if t else float("nan") for a, t in zip(self.accepted_by_pos, self.tried_by_pos)]

    def summary(self) -> dict:
        return {"tokens_per_step": round(self.tokens_per_step, 3), "steps": self.steps, "p_by_position": self.p()}


def measure(drafter, embed, head_w, items, classes: list[str] | None = None) -> dict[str, Acceptance]:
    """Replayed chain acceptance of `drafter` on `items` ((ids, response start, features)); by class and "all"."""
    import torch

    from dflash_models.drafter_model import block_labels

    bs = drafter.block_size
    out: dict[str, Acceptance] = {}

    def acc_of(name: str) -> Acceptance:
        return out.setdefault(name, Acceptance(accepted_by_pos=[0] * (bs - 1), tried_by_pos=[0] * (bs - 1)))

    from dflash_models.learn.distill import autocast_like

    device = head_w.device  # the target's (learning.device); the drafter is moved there
    drafter.to(device)
    with torch.no_grad(), autocast_like(head_w):
        for n, (seq, start, feats) in enumerate(items):
            last = min(len(seq) - 1, start + MAX_ANCHORS)
            if last <= start:
                continue
            tokens = torch.tensor([seq], device=device)
            anchors = torch.arange(start, last, device=device)[None]
            hidden = drafter(feats[None].float().to(device), tokens, anchors, embed)  # [1, N, bs, H]
            pred = (hidden[0, :, 1:] @ head_w.T).argmax(-1)  # [N, bs-1]
            labels, valid = block_labels(tokens, anchors, bs, torch.tensor([len(seq)], device=device))
            hit = ((pred == labels[0, :, 1:]) & valid[0, :, 1:]).tolist()
            names = ["all"] + ([classes[n]] if classes else [])
            seq_tokens = seq_steps = 0
            p = start
            while p < last:
                row = hit[p - start]
                k = 0
                while k < bs - 1 and row[k]:
                    k += 1
                room = len(seq) - 1 - p  # tokens left to commit after the anchor
                commit = min(k + 1, room)
                for name in names:
                    a = acc_of(name)
                    a.steps += 1
                    a.tokens += commit
                    for j in range(min(k + 1, bs - 1, room)):  # positions tried: the accepted ones and the first miss
                        a.tried_by_pos[j] += 1
                        a.accepted_by_pos[j] += int(j < k)
                seq_tokens, seq_steps = seq_tokens + commit, seq_steps + 1
                p += commit
            for name in names:
                acc_of(name).per_sequence.append((seq_tokens, seq_steps))
    return out


def better_share(serving: Acceptance, candidate: Acceptance, resamples: int = 1000, seed: int = 0) -> float:
    """Share of paired bootstrap resamples of the sequences in which the candidate's tokens per step beat the
    serving drafter's (both measured on the same sequences, in the same order)."""
    pairs = list(zip(serving.per_sequence, candidate.per_sequence))
    if not pairs:
        return 0.0
    rng = random.Random(seed)
    n, wins = len(pairs), 0
    for _ in range(resamples):
        st = ss = ct = cs = 0
        for _ in range(n):
            (a, b), (c, d) = pairs[rng.randrange(n)]
            st, ss, ct, cs = st + a, ss + b, ct + c, cs + d
        wins += ct * ss > st * cs  # ct/cs > st/ss without dividing by zero
    return wins / resamples


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    recent_serving: float
    recent_candidate: float
    original_serving: float
    original_candidate: float

    def record(self) -> dict:
        return {"promote": self.promote, "reason": self.reason,
                "recent": {"serving": round(self.recent_serving, 3), "candidate": round(self.recent_candidate, 3)},
                "original": {"serving": round(self.original_serving, 3),
                             "candidate": round(self.original_candidate, 3)}}


def decide(recent_serving: float, recent_candidate: float, original_serving: float, original_candidate: float,
           margin: float, max_original_loss: float, better: float | None = None,
           confidence: float = 0.95, original_initial: float | None = None) -> Decision:
    """Promote iff recent gains >= `margin` (a fraction), the candidate beat the serving drafter in at least
    `confidence` of the resamples of the recent slice (`better`, from `better_share`; None: not checked), and the
    original mix loses <= `max_original_loss` against the config's own drafter (`original_initial`; None: the
    serving one). Against the first drafter, not the serving one: each promotion's allowed loss would otherwise
    add up across promotions."""
    gain = recent_candidate / recent_serving - 1
    reference = original_serving if original_initial is None else original_initial
    against = "the serving drafter" if original_initial is None else "the config's drafter"
    loss = 1 - original_candidate / reference
    if gain < margin:
        why = f"recent traffic {recent_candidate:.3f} vs {recent_serving:.3f} tokens/step: {gain:+.1%} < +{margin:.0%}"
        return Decision(False, why, recent_serving, recent_candidate, original_serving, original_candidate)
    if better is not None and better < confidence:
        why = (f"recent traffic {gain:+.1%} but better in only {better:.0%} of resamples of the held-out slice "
               f"(< {confidence:.0%}): not distinguishable from the serving drafter yet")
        return Decision(False, why, recent_serving, recent_candidate, original_serving, original_candidate)
    if loss > max_original_loss:
        why = (f"original mix {original_candidate:.3f} vs {reference:.3f} tokens/step of {against}: "
               f"{-loss:+.1%} loses more than {max_original_loss:.0%}")
        return Decision(False, why, recent_serving, recent_candidate, original_serving, original_candidate)
    sure = f", better in {better:.0%} of resamples" if better is not None else ""
    why = (f"recent traffic {gain:+.1%} (>= +{margin:.0%}{sure}), original mix {-loss:+.1%} against {against} "
           f"(>= -{max_original_loss:.0%})")
    return Decision(True, why, recent_serving, recent_candidate, original_serving, original_candidate)
