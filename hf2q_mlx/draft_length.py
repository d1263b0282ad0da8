"""How many tokens a speculative round drafts: the k in 0..K with the most expected tokens per
second, from the acceptance seen so far and the measured wall time of each verify length."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


def expected_tokens(p: float, k: int) -> float:
    """Tokens a round of k drafts emits when each draft is accepted with probability p (until
    the first rejection): the accepted drafts plus the target's own token."""
    if p >= 1.0 - 1e-12:
        return k + 1.0
    return (1.0 - p ** (k + 1)) / (1.0 - p)


@dataclass
class RoundCosts:
    """What a controller learned about round times, kept for the next generation on the same
    compiled step and drafter: the moving average per verify length L, and the lengths whose
    first (possibly compiling) sample came in. A round's cost depends on the model, the step
    and the drafter, not on the text, so a later request starts from it instead of measuring K
    drafts and plain steps again and dropping each length's first sample."""

    cost: dict[int, float] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)


class DraftLength:
    """Picks each round's draft count k in 0..K (K = ``max_drafts``; k = 0: a plain one-token
    step, a verify of L = 1).

    Acceptance: each draft is taken as accepted with probability p, independently, until the
    first rejection, so a round of k drafts emits ``expected_tokens(p, k)``. p = S / (S + F)
    over accepted drafts S and first rejections F (a geometric count: a round that accepts all
    its drafts adds no failure), both multiplied by ``decay`` each drafting round so that p
    follows the text, from an optimistic prior (``prior`` with a weight of ``prior_weight``
    drafts).

    Cost: t(L), the wall time of a round whose verify takes L = k + 1 tokens, from the start of
    its drafting to the host read of the verify's decisions. A draft model's k forwards thus
    count in the round that uses them: its drafts and the verify are evaluated together with one
    read-back, so timing them apart would need another sync. One moving average per L (a new
    sample weighs ``alpha``, more when that L was last measured rounds ago: the old value fades
    by 1 - ``alpha`` per round); the first sample of each L is dropped, as it may include
    compiling that length's trace. An unmeasured L is linear between the nearest measured
    lengths and flat beyond them.

    Choice: the k maximizing expected_tokens(p, k) / t(k + 1). Until both ends are measured the
    controller measures them: K drafts, then plain steps. Every ``explore_every`` rounds it plays
    a neighbour of the best k instead (k - 1 or k + 1, the one measured longest ago; again the
    next round when that length had no sample yet), so that a cost measured under load, or an
    acceptance that changed while k = 0 drew no drafts, does not pin the choice, and a cost
    that is not linear in L is found out step by step. ``adaptive=False``: always K.

    The choice reads only past rounds, never the current round's drafts or random draws: so
    speculative sampling keeps the target's distribution, and greedy output its tokens.
    ``clock`` (seconds) is a class attribute so tests can drive the controller with fake costs.
    ``memory``: a ``RoundCosts`` shared with earlier controllers of the same step and drafter
    (``speculative.round_costs``); their costs seed this one and it updates them in place.
    """

    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(
        self,
        max_drafts: int,
        adaptive: bool = True,
        *,
        prior: float = 0.8,
        prior_weight: float = 4.0,
        decay: float = 0.95,
        alpha: float = 0.2,
        explore_every: int = 16,
        memory: RoundCosts | None = None,
    ):
        self.max_drafts, self.adaptive = max_drafts, adaptive
        self.accepted = prior * prior_weight  # S: decayed accepted drafts
        self.rejected = (1.0 - prior) * prior_weight  # F: decayed first rejections
        self.decay, self.alpha, self.explore_every = decay, alpha, explore_every
        memory = memory if memory is not None else RoundCosts()
        self.cost = memory.cost  # L -> moving average of the round's seconds (shared)
        self.seen = memory.seen  # lengths whose first (dropped) sample came in (shared)
        self.rounds = 0  # rounds chosen after the start-up measurements
        self.measured_at = dict.fromkeys(self.cost, 0)  # L -> the round of its latest sample
        self.pending: int | None = None  # an exploration to repeat (its sample was dropped)
        self.exploring = False

    @property
    def p(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def seconds(self, L: int) -> float | None:
        """Estimated wall time of a round verifying L tokens (None: nothing measured yet)."""
        if L in self.cost:
            return self.cost[L]
        below = [m for m in self.cost if m < L]
        above = [m for m in self.cost if m > L]
        if below and above:
            lo, hi = max(below), min(above)
            w = (L - lo) / (hi - lo)
            return (1.0 - w) * self.cost[lo] + w * self.cost[hi]
        if below or above:
            return self.cost[max(below) if below else min(above)]
        return None

    def rates(self) -> list[float]:
        """Expected tokens per second of k = 0..K drafts (needs one measured length)."""
        p = self.p
        return [
            expected_tokens(p, k) / max(self.seconds(k + 1), 1e-9)  # a coarse clock may read 0
            for k in range(self.max_drafts + 1)
        ]

    def choose(self) -> int:
        """This round's number of drafts, from the rounds so far only."""
        self.exploring = False
        K = self.max_drafts
        if not self.adaptive or K == 0:
            return K
        if not any(L > 1 for L in self.cost):
            return K  # start optimistic: measure a full round first
        if 1 not in self.cost:
            return 0  # then a plain step
        if self.pending is not None:
            k, self.pending = self.pending, None
            self.exploring = True
            return k
        rates = self.rates()
        best = max(range(K + 1), key=lambda k: (rates[k], -k))  # ties: fewer drafts
        self.rounds += 1
        if self.rounds % self.explore_every == 0:
            self.exploring = True
            near = [k for k in (best - 1, best + 1) if 0 <= k <= K]
            return min(near, key=lambda k: self.measured_at.get(k + 1, -1))
        return best

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        """A round verified ``drafted`` drafts (L = drafted + 1), kept ``accepted`` of them, and
        took ``seconds`` from its drafting to the host read of its verify."""
        if drafted > 0:
            self.accepted = self.decay * self.accepted + accepted
            self.rejected = self.decay * self.rejected + (accepted < drafted)
        L = drafted + 1
        if L not in self.seen:
            self.seen.add(L)  # the first sample of a length may include compiling its trace
            if self.exploring:
                self.pending = drafted
            return
        old = self.cost.get(L)
        # the old estimate fades per round, not per sample: a length tried again after many
        # rounds (an exploration) is mostly its new sample
        age = max(1, self.rounds - self.measured_at.get(L, self.rounds))
        self.measured_at[L] = self.rounds
        keep = (1.0 - self.alpha) ** age
        self.cost[L] = seconds if old is None else keep * old + (1.0 - keep) * seconds
