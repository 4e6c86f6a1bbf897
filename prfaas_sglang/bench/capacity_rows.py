"""What `bench compare --capacity` compares: deployments, rows, and each peer's sweep grid (pure data).

A *row* is a router over a deployment. Ours run in the product's default configuration and in
the ablations that take one mechanism away. Every peer gets a grid of its own configurations,
drawn from its documented knobs and its source (sglang-router 0.3.2, smg 1.13: the prefill
policies, their load signals and balance thresholds, and the peer's own admission); a short
sweep picks each family's best, and only the best is bisected. Why each grid entry is there
is said next to it, so a reader can check that nothing the peer offers was left out.

Deployments (the paper's case study in miniature, 32 H200 + 64 H20 GPUs vs 96 H20):

    hetero       PrfaaS (8xH200, its egress over the shaped link) + PD-P + PD-D (8xH20)
    naive        PrfaaS (8xH200, shaped link) + 2 PD-D: every prefill remote
    homog-2p1d   3 x 8xH20, two prefill and one decode instance
    homog-1p2d   3 x 8xH20, one prefill and two decode instances

Admission is swept for every family (issue #59): sglang-router's concurrency cap over
:data:`CONCURRENCY_CAPS` with its queue, smg's own cap, in-flight limits, queue timeout and shedding,
on the heterogeneous deployment and on naive and homogeneous ones alike. The ``dynamo-like``
family is a baseline of the kind Dynamo's conditional disaggregation offers, run by our router's
code (``--placement conditional``): the length rule, PrfaaS only while its queue is under a cap,
no early rejection, configured as an operator would.
"""

from __future__ import annotations

from dataclasses import dataclass

from prfaas_sglang.errors import ConfigError

# (PrfaaS, PD prefill, PD decode) instances; shaped: the PrfaaS egress crosses the link
DEPLOYMENTS = {"hetero": (1, 1, 1), "naive": (1, 0, 2), "homog-2p1d": (0, 2, 1), "homog-1p2d": (0, 1, 2),
               "hetero-layerwise": (1, 1, 1)}
SHAPED = ("hetero", "naive", "hetero-layerwise")
# Deployments whose link streams KV by layer (links[].layerwise): the PrfaaS engines send each layer group as it is
# written, and our router's estimate overlaps it. A separate deployment, so an ablation row runs beside the rest.
LAYERWISE = ("hetero-layerwise",)


class KnobClockError(ConfigError):
    """A peer's time-valued knob that the peer cannot be given at this speedup (it takes whole wall seconds)."""


def _whole(flag: str, value: float, stated: str) -> str:
    """``value`` as the peer's argument: both peers take whole numbers of at least 1 (argparse ``type=int``)."""
    if value < 1 or abs(value - round(value)) > 1e-9:
        raise KnobClockError(flag, f"{stated}: the peer takes whole numbers of at least 1 only")
    return str(round(value))


@dataclass(frozen=True)
class EmulatedSeconds:
    """A peer flag whose value is a duration, stated on the emulated clock: the peer gets
    ``seconds / speedup`` wall seconds, a whole number (speedups that express it: ``seconds / k``)."""

    flag: str
    seconds: float

    def wall(self, speedup: float) -> str:
        wall_s = self.seconds / speedup
        return _whole(self.flag, wall_s, f"{self.seconds:g} emulated s is {wall_s:g} wall s at speedup {speedup:g}")

    def emulated(self, speedup: float) -> float:
        return self.seconds


@dataclass(frozen=True)
class PerEmulatedSecond:
    """A peer flag whose value is a rate, per emulated second: the peer gets ``rate x speedup`` per wall
    second, a whole number."""

    flag: str
    rate: float

    def wall(self, speedup: float) -> str:
        per_wall_s = self.rate * speedup
        return _whole(self.flag, per_wall_s, f"{self.rate:g} per emulated s is {per_wall_s:g} per wall s at speedup "
                                             f"{speedup:g}")

    def emulated(self, speedup: float) -> float:
        return self.rate


@dataclass(frozen=True)
class Fastest:
    """A peer's period flag (a poll or re-balance interval) at the smallest value it accepts, 1 wall second:
    ``speedup`` emulated seconds, the peer's own floor on this clock (a run at speedup 1 gives it 1 s)."""

    flag: str

    def wall(self, speedup: float) -> str:
        return "1"

    def emulated(self, speedup: float) -> float:
        return float(speedup)


Knob = EmulatedSeconds | PerEmulatedSecond | Fastest


def peer_args(args: tuple[str | Knob, ...], speedup: float) -> tuple[str, ...]:
    """A row's flags as the peer process gets them at ``speedup``: each time-valued knob converted from the
    emulated clock to wall time (:class:`KnobClockError` where the peer cannot take the value)."""
    out: list[str] = []
    for arg in args:
        out.extend((arg,) if isinstance(arg, str) else (arg.flag, arg.wall(speedup)))
    return tuple(out)


def emulated_knobs(args: tuple[str | Knob, ...], speedup: float) -> dict[str, float]:
    """Each time-valued knob of ``args`` on the emulated clock at ``speedup`` (what a reader compares with the SLO):
    seconds for durations and periods, per second for rates."""
    return {arg.flag: arg.emulated(speedup) for arg in args if not isinstance(arg, str)}


@dataclass(frozen=True)
class Row:
    """One router over one deployment. ``router``: ``prfaas`` (ours) or a peer (``sglang-router``, ``smg``);
    ``args``: its flags beyond the workers and policies (a peer's time-valued ones as :data:`Knob`, on the
    emulated clock: :func:`peer_args` renders them for a speedup); ``prefill``: which prefill workers a peer is given
    (``all``: the PD-P worker first, then PrfaaS, so a length bucket puts the short prompts on PD-P; ``prfaas``:
    the PrfaaS worker alone)."""

    name: str
    family: str  # ours | sglang-router | smg | naive | homogeneous | dynamo-like
    deployment: str
    router: str
    args: tuple[str | Knob, ...] = ()
    prefill: str = "all"
    prefill_policy: str = "cache_aware"
    decode_policy: str | None = None  # None: start_peer_router's choice (power_of_two over 2+ decode workers)
    why: str = ""


OURS = (
    Row("prfaas", "ours", "hetero", "prfaas", (), why="the product's defaults: placement by expected TTFT, calibration, "
        "early rejection"),
    Row("prfaas-routing-only", "ours", "hetero", "prfaas", ("--no-early-rejection",),
        why="ablation: placement by expected TTFT, admission off"),
    Row("prfaas-admission-only", "ours", "hetero", "prfaas", ("--placement", "threshold"),
        why="ablation: the paper's threshold rule (with the SLO spill of early rejection), admission on"),
    Row("prfaas-rule-only", "ours", "hetero", "prfaas", ("--placement", "threshold", "--no-early-rejection"),
        why="ablation: the paper's threshold rule alone"),
    Row("prfaas-auto-mode", "ours", "hetero", "prfaas", ("--bandwidth-mode", "auto"),
        why="the paper's abundant mode where the link's measured capacity allows it (judge the prefix by the longer "
            "cache of either cluster and move it across), scarce mode otherwise"),
    Row("prfaas-target-0", "ours", "hetero", "prfaas", ("--ttft-target-s", "0"),
        why="placement target 0: always the cluster with the lower expected TTFT (the default keeps the rule's "
            "cluster while it meets the SLO)"),
    Row("prfaas-layerwise", "ours", "hetero-layerwise", "prfaas", (),
        why="ablation: the same router over engines that stream their KV by layer group while they prefill "
            "(links[].layerwise; its estimate overlaps prefill and transfer)"),
)

# Every time-valued peer knob is stated on the emulated clock (EmulatedSeconds, PerEmulatedSecond) and
# converted for the run's speedup; a poll or re-balance period is the peer's smallest (Fastest: 1 wall s,
# `speedup` emulated s). Both peers take whole seconds only: at the default speedup 4 a queue timeout is a
# multiple of 4 emulated seconds; a shorter one needs a run at a speedup that expresses it (KnobClockError).
# sglang-router 0.3.2. Its load signals: in-flight counts it keeps itself (cache_aware, which for a
# streamed PD request starts counting only after the prefill answered) or /get_load polled every
# --worker-startup-check-interval (power_of_two; default 30 s). Its admission: a token bucket of
# --max-concurrent-requests refilled at --rate-limit-tokens-per-second, a queue, 408 on its timeout.
CONCURRENCY_CAPS = (4, 8, 16, 32)  # in flight at once, swept for every family whose router has a cap


def sr_admission(cap: int, refill_per_s: float | None = None) -> tuple[str | Knob, ...]:
    """sglang-router's admission (smg's is the same flags): at most ``cap`` in flight, the token bucket refilled
    at ``refill_per_s`` a second (default ``cap``, its own default, on the emulated clock), a queue that refuses
    after 4 emulated seconds."""
    return ("--max-concurrent-requests", str(cap), PerEmulatedSecond("--rate-limit-tokens-per-second", refill_per_s or cap),
            "--queue-size", "256", EmulatedSeconds("--queue-timeout-secs", 4))
SGLANG_ROUTER = (
    Row("sr-cache_aware", "sglang-router", "hetero", "sglang-router", why="its default"),
    Row("sr-round_robin", "sglang-router", "hetero", "sglang-router", prefill_policy="round_robin",
        why="speed-blind 50/50 split"),
    Row("sr-power_of_two", "sglang-router", "hetero", "sglang-router", (Fastest("--worker-startup-check-interval"),),
        prefill_policy="power_of_two", why="its load-aware policy, loads polled as often as it can (default 30 s)"),
    Row("sr-bucket", "sglang-router", "hetero", "sglang-router", (Fastest("--bucket-adjust-interval-secs"),),
        prefill_policy="bucket", why="its length-aware policy: short prompts on the first worker (PD-P), long on "
        "PrfaaS; boundaries re-balanced as often as it can (default 5 s)"),
    Row("sr-prfaas-only", "sglang-router", "hetero", "sglang-router", prefill="prfaas",
        why="the fast worker does every prefill (the obvious setting of a length-blind router)"),
    Row("sr-cache_aware-admit8", "sglang-router", "hetero", "sglang-router",
        sr_admission(8, refill_per_s=1), why="its admission: ~8 in flight (Little's law "
        "at the planned capacity), a 4 s queue timeout (emulated)"),
    Row("sr-power_of_two-admit8", "sglang-router", "hetero", "sglang-router",
        (Fastest("--worker-startup-check-interval"), *sr_admission(8, refill_per_s=1)),
        prefill_policy="power_of_two", why="load-aware policy with its admission"),
    *(Row(f"sr-{policy}-cap{cap}", "sglang-router", "hetero", "sglang-router", (*extra, *sr_admission(cap)),
          prefill_policy=policy, why=f"its admission swept: {cap} in flight, the bucket refilled at {cap}/s")
      for policy, extra in (("cache_aware", ()), ("power_of_two", (Fastest("--worker-startup-check-interval"),)))
      for cap in CONCURRENCY_CAPS),
)

# smg 1.13. Loads polled every --load-monitor-interval (default 10 s); overload protection (on by
# default) leaves out a worker reporting >= 8 waiting requests or >= 0.8 KV usage and, when all are
# out, bypasses the policy. --job-queue-concurrency 1 registers workers in flag order (bucket order).
SMG_FRESH = (Fastest("--load-monitor-interval"), "--job-queue-concurrency", "1")
SMG_P2_LEAST = ("--power-of-two-load-metric", "least_requests", *SMG_FRESH)
SMG = (
    Row("smg-cache_aware", "smg", "hetero", "smg", ("--job-queue-concurrency", "1"), why="its default"),
    Row("smg-cache_aware-fresh", "smg", "hetero", "smg", (*SMG_FRESH, "--disable-worker-overload-protection"),
        why="default policy, loads every second, no overload bypass"),
    Row("smg-least_load", "smg", "hetero", "smg",
        ("--least-load-mean-prefill-tokens", "21000", "--least-load-kv-pressure-weight", "0", *SMG_FRESH),
        prefill_policy="least_load", why="its expected-wait policy, told the workload's mean prompt (default 1024)"),
    Row("smg-power_of_two", "smg", "hetero", "smg", SMG_P2_LEAST, prefill_policy="power_of_two",
        why="fewest in-flight prefill legs (exact, its own count; includes the KV's time on the link)"),
    Row("smg-round_robin", "smg", "hetero", "smg", ("--job-queue-concurrency", "1"), prefill_policy="round_robin",
        why="speed-blind split"),
    Row("smg-bucket", "smg", "hetero", "smg", ("--job-queue-concurrency", "1", "--disable-worker-overload-protection",
                                                Fastest("--bucket-adjust-interval-secs")),
        prefill_policy="bucket", why="its length-aware policy, PD-P on the short bucket, re-balanced as often as it can "
        "(overload protection off: with it a bucket whose worker is marked overloaded answers 503)"),
    Row("smg-p2-inflight2", "smg", "hetero", "smg",
        (*SMG_P2_LEAST, "--prefill-max-inflight-requests-per-worker", "2", "--prefill-queue-size", "4096"),
        prefill_policy="power_of_two", why="a shared router queue, 2 prefill legs per worker: whichever frees first "
        "takes the next (the fast worker takes more)"),
    Row("smg-p2-inflight4", "smg", "hetero", "smg",
        (*SMG_P2_LEAST, "--prefill-max-inflight-requests-per-worker", "4", "--prefill-queue-size", "4096"),
        prefill_policy="power_of_two", why="the same, 4 legs per worker"),
    Row("smg-p2-inflight2-timeout", "smg", "hetero", "smg",
        (*SMG_P2_LEAST, "--prefill-max-inflight-requests-per-worker", "2", "--prefill-queue-size", "4096",
         EmulatedSeconds("--prefill-queue-timeout-secs", 4)),
        prefill_policy="power_of_two", why="its nearest thing to early rejection: refuse what waited 4 s (emulated) in "
        "its queue"),
    Row("smg-p2-shed", "smg", "hetero", "smg", (*SMG_P2_LEAST, "--worker-overload-shed"), prefill_policy="power_of_two",
        why="its overload protection shedding (503) instead of steering"),
    *(Row(f"smg-p2-cap{cap}", "smg", "hetero", "smg", (*SMG_P2_LEAST, *sr_admission(cap)), prefill_policy="power_of_two",
          why=f"its own concurrency cap swept: {cap} in flight, a queue timing out after 4 s (emulated)")
      for cap in CONCURRENCY_CAPS),
)

NAIVE = (
    Row("naive-sr-cache_aware", "naive", "naive", "sglang-router", why="sglang-router's default (power_of_two decode)"),
    Row("naive-sr-round_robin", "naive", "naive", "sglang-router", prefill_policy="round_robin", decode_policy="round_robin",
        why="decode split evenly"),
    Row("naive-smg-power_of_two", "naive", "naive", "smg", SMG_P2_LEAST, prefill_policy="round_robin",
        decode_policy="power_of_two", why="smg, fewest in flight on the decode leg (one prefill worker: smg "
        "refuses power_of_two over one)"),
    *(Row(f"naive-sr-cap{cap}", "naive", "naive", "sglang-router", sr_admission(cap),
          why=f"sglang-router's admission swept: {cap} in flight (a remote prefill queue kept short)")
      for cap in CONCURRENCY_CAPS),
    Row("naive-smg-inflight2", "naive", "naive", "smg",
        (*SMG_P2_LEAST, "--prefill-max-inflight-requests-per-worker", "2", "--prefill-queue-size", "4096",
         EmulatedSeconds("--prefill-queue-timeout-secs", 4)), prefill_policy="round_robin", decode_policy="power_of_two",
        why="smg's prefill in-flight limit and queue timeout on the one remote prefill worker"),
    Row("naive-smg-shed", "naive", "naive", "smg", (*SMG_P2_LEAST, "--worker-overload-shed"), prefill_policy="round_robin",
        decode_policy="power_of_two", why="smg's overload shedding (503)"),
)

HOMOGENEOUS = tuple(
    row for split in ("2p1d", "1p2d") for row in (
        Row(f"homog-{split}-sr-cache_aware", "homogeneous", f"homog-{split}", "sglang-router", why="the planner's "
            "split is 2P1D; both splits swept"),
        Row(f"homog-{split}-sr-round_robin", "homogeneous", f"homog-{split}", "sglang-router", prefill_policy="round_robin",
            decode_policy="round_robin", why="even split"),
        Row(f"homog-{split}-smg-power_of_two", "homogeneous", f"homog-{split}", "smg", SMG_P2_LEAST,
            prefill_policy="power_of_two" if split == "2p1d" else "round_robin",
            decode_policy="power_of_two" if split == "1p2d" else "round_robin",
            why="fewest in flight where a leg has two workers (smg refuses power_of_two over one)"),
        *(Row(f"homog-{split}-sr-cap{cap}", "homogeneous", f"homog-{split}", "sglang-router", sr_admission(cap),
              why=f"sglang-router's admission swept: {cap} in flight") for cap in CONCURRENCY_CAPS),
        Row(f"homog-{split}-smg-shed", "homogeneous", f"homog-{split}", "smg", (*SMG_P2_LEAST, "--worker-overload-shed"),
            prefill_policy="power_of_two" if split == "2p1d" else "round_robin",
            decode_policy="power_of_two" if split == "1p2d" else "round_robin", why="smg's overload shedding (503)"),
    ))

# The Dynamo-like baseline (labelled as such; our router's code in a mode of its own): the length rule at the
# topology's t, PrfaaS only while its prefill workers hold fewer than the cap, no early rejection.
DYNAMO_LIKE = tuple(
    Row(f"dynamo-like-q{cap}", "dynamo-like", "hetero", "prfaas",
        ("--placement", "conditional", "--remote-queue-cap", str(cap), "--no-early-rejection"),
        why=f"a baseline of the kind Dynamo's conditional disaggregation offers: remote prefill above t while fewer "
            f"than {cap} wait there")
    for cap in (1, 2, 4, 8))

# Ours with a model that disagrees with the engines (the bias study): calibration off, and the
# operator's measured scale given up front (the model then matches the truth's mean).
def oracle_row(bias: float) -> Row:
    return Row(f"prfaas-measured-{bias:g}", "ours", "hetero", "prfaas",
               ("--no-calibration", "--prefill-scale", f"prfaas={bias:g}", "--prefill-scale", f"pd={bias:g}"),
               why=f"the model scaled by the true mean factor ({bias:g}), no online calibration")


NO_CALIBRATION = Row("prfaas-no-calibration", "ours", "hetero", "prfaas", ("--no-calibration",),
                     why="the topology's model as given, no online calibration")
# The deployment apart from the router: ours on the naive deployment's nodes (the H200 prefills every prompt, both
# H20s decode). Beside a naive row it is the router's share of a gap; beside ``prfaas``, the split's.
NAIVE_SPLIT = Row("prfaas-naive-split", "ours", "naive", "prfaas", (),
                  why="ablation: our router on the naive deployment's split (0P/2D: every prefill on PrfaaS)")

PEERS = SGLANG_ROUTER + SMG + NAIVE + HOMOGENEOUS + DYNAMO_LIKE
ALL = {r.name: r for r in OURS + PEERS + (NO_CALIBRATION, NAIVE_SPLIT)}
FAMILIES = ("sglang-router", "smg", "naive", "homogeneous", "dynamo-like")


def is_ours(name: str) -> bool:
    """Whether the row called ``name`` runs our router (ours, an ablation of it, or the model given or scaled);
    False for a peer's and for a name no row has."""
    return name.startswith("prfaas-measured-") or (name in ALL and ALL[name].family == "ours")


def row_named(name: str) -> Row:
    """A row by name (``prfaas-measured-B``: ours with the true scale B given; KeyError for an unknown one)."""
    if name.startswith("prfaas-measured-"):
        return oracle_row(float(name[len("prfaas-measured-"):]))
    return ALL[name]


def family_rows(family: str) -> tuple[Row, ...]:
    return tuple(r for r in PEERS if r.family == family)
