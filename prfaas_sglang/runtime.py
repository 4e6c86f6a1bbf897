"""The scheduler's model of a deployment, built from its topology, in one place (pure).

Router, kv-index, demo, benchmarks and the launcher's emulated engines all call
:func:`from_topology`; nothing else outside the planner builds a
:class:`~prfaas_sglang.plan.model.Deployment`. So for one topology they agree on
the cost profiles and on the threshold ``t``.

Units. Everything here is in the units the router *observes*: seconds of the
engines' wall clock and bytes on the wire. Real SGLang engines run at scale 1.
Emulated engines (``--engine mock``) run as the topology's ``emulation:`` says:
every duration divided by ``speedup``, ``kv_scale`` of the KV bytes shipped; for
them (``emulated=True``) the profiles are scaled the same way, and a link's
capacity (what telemetry measures) needs no conversion. The same file thus
describes a deployment of real engines (the section is ignored) and its
emulation::

    T_observed(l) = T_prefill(l) / speedup        S_observed(l) = S_kv(l) * kv_scale
    T_decode_observed = T_decode / speedup         B_out = the link's bits/s on the wire

The threshold is scale-free when every engine shares one ``speedup``; the
bandwidth term is not, which is the point: a link binds when it binds on the wire.

Inputs and their defaults (each stated in ``/status`` under ``"model"``):

    cost model      model.cost_model                    kimi-linear-1t-hybrid
    PrfaaS class    clusters.<prfaas>.accelerator|profile   h200x8
    PD class        clusters.<pd>.accelerator|profile       h20x8
    link            the first prfaas <-> pd link          100 Gbps
    workload prior  scheduler.workload                  the case study's log-normal
    L_out, SLO      scheduler.output_tokens / slo_tokens_per_s   1024, 40 tok/s
    TTFT SLO        scheduler.ttft_slo_s                10 s (model time; early rejection)
    BS_max          scheduler.decode_batch              the PD class's decode profile
    baseline t      scheduler.threshold_tokens          the planner's t for the link
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prfaas_sglang.errors import ConfigError
from prfaas_sglang.plan.analytic import AnalyticPrefill, analytic_decode
from prfaas_sglang.plan.fleet_model import (
    Fleet,
    FleetLink,
    PdChoice,
    PdSite,
    PrfaasSite,
    evaluate_fleet,
)
from prfaas_sglang.plan.model import Deployment, OperatingPoint, evaluate, evaluate_pooled
from prfaas_sglang.plan.profiles import DecodeProfile, InstanceClass, PrefillProfile, ScaledPrefill
from prfaas_sglang.plan.scenario import (
    Catalog,
    measured_state,
    parse_measured_profile,
    parse_workload,
)
from prfaas_sglang.plan.search import best_threshold_for_split, search, search_pooled
from prfaas_sglang.plan.workload import CASE_STUDY_LENGTHS, Workload
from prfaas_sglang.roles import ROLE_SPECS, Role
from prfaas_sglang.topology import ClusterSpec, Emulation, SitePair, Topology

DEFAULT_COST_MODEL = "kimi-linear-1t-hybrid"
DEFAULT_ACCELERATOR = {"prfaas": "h200x8", "pd": "h20x8"}
DEFAULT_LINK_BPS = 100e9
DEFAULT_OUTPUT_TOKENS = 1024
DEFAULT_SLO_TOKENS_PER_S = 40.0
DEFAULT_TTFT_SLO_S = 10.0
DEFAULT_STEP_TOKENS = 128.0


@dataclass(frozen=True)
class ClusterCost:
    """One cluster kind's instances: the planner's class (model units) and how to emulate one."""

    kind: str  # prfaas | pd
    instance: InstanceClass  # model units (seconds of the real accelerator, real KV bytes)
    engine_profile: str  # what ``--engine mock --profile`` takes: MODEL@ACCELERATOR or a profile file
    source: str  # where the profile came from, for /status
    state: str  # "recurrent" | "swa" | "recurrent+swa" | "none" (:func:`state_kind`; measured profiles: none)

    @property
    def hybrid(self) -> bool:
        """Linear-attention or SWA state: prefix reuse stops at its checkpoints."""
        return self.state != "none"


@dataclass(frozen=True)
class RuntimeModel:
    """Counts, costs and workload of one deployment, in observed units (see the module docstring)."""

    deployment: Deployment  # observed units; egress_bps = the link's nominal capacity
    n_prefill: int  # PD-P instances (the split is fixed in the short term)
    n_decode: int
    prior: Workload
    output_tokens: int
    slo_tokens_per_s: float
    step_tokens: float
    emulation: Emulation
    costs: dict[str, ClusterCost]  # model units
    operator_threshold_tokens: float | None
    defaults_used: tuple[str, ...]  # which inputs fell back to a default
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S  # model time
    state: str = "none"  # the PD cost model's kind of state (:func:`state_kind`): what workers must serve
    layerwise: bool = False  # the link's PrfaaS side streams KV by layer (links[].layerwise; plan/overlap.py)

    @property
    def hybrid(self) -> bool:
        """The cost model has linear-attention / SWA state (prefix reuse stops at checkpoints)."""
        return self.state != "none"

    @property
    def observed_ttft_slo_s(self) -> float:
        """The TTFT SLO on the engines' clock (emulated engines run ``speedup`` times faster)."""
        return self.ttft_slo_s / self.emulation.speedup

    # --- cost profiles in observed units ----------------------------------------------

    def prefill_cost(self, kind: str) -> PrefillProfile:
        """``T_prefill`` and ``S_kv`` of one instance of ``kind`` as the router sees them."""
        return self.deployment.prfaas.prefill if kind == "prfaas" else self.deployment.pd.prefill

    def kv_bytes(self, tokens: float) -> float:
        """Bytes on the wire for a request of ``tokens`` (the PD class's S_kv, scaled)."""
        return self.deployment.pd.prefill.kv_bytes(tokens)

    @property
    def decode(self) -> DecodeProfile:
        return self.deployment.pd.decode

    @property
    def link_bps(self) -> float:
        return self.deployment.egress_bps

    # --- the threshold ---------------------------------------------------------------

    def operating_point(self, capacity_bps: float | None = None, workload: Workload | None = None) -> OperatingPoint:
        """The planner's best ``t`` for the fixed PD split, on ``capacity_bps`` (default: the
        nominal link) and ``workload`` (default: the prior)."""
        dep = self.deployment
        if capacity_bps is not None:
            dep = dataclasses.replace(dep, egress_bps=max(capacity_bps, 1.0))
        return best_threshold_for_split(dep, workload or self.prior, self.n_prefill, self.step_tokens)

    def with_split(self, n_prefill: int) -> RuntimeModel:
        """The same deployment with ``n_prefill`` PD-P instances and the rest PD-D (a long-term
        conversion); raises ConfigError unless both roles keep at least one instance."""
        n_pd = self.deployment.n_pd
        if not 1 <= n_prefill <= n_pd - 1:
            raise ConfigError("n_prefill", f"must be in 1..{n_pd - 1} (one instance per role at least), got {n_prefill}")
        return dataclasses.replace(self, n_prefill=n_prefill, n_decode=n_pd - n_prefill)

    def calibrated(self, scales: Mapping[str, float]) -> RuntimeModel:
        """The model with each stage's capacity scaled by what was measured (``measured / modelled``):
        ``prfaas`` and ``pd-prefill`` divide ``T_prefill``, ``pd-decode`` multiplies ``BS_max``.
        Missing stages keep scale 1. The link and ``S_kv`` are unchanged (telemetry measures the link)."""
        dep = self.deployment

        def prefill(cls: InstanceClass, scale: float) -> InstanceClass:
            return cls if scale == 1.0 else dataclasses.replace(cls, prefill=ScaledPrefill(cls.prefill, 1.0 / scale))

        pd = prefill(dep.pd, scales.get("pd-prefill", 1.0))
        decode_scale = scales.get("pd-decode", 1.0)
        if decode_scale != 1.0:
            pd = dataclasses.replace(pd, decode=dataclasses.replace(pd.decode, bs_max=pd.decode.bs_max * decode_scale))
        dep = dataclasses.replace(dep, prfaas=prefill(dep.prfaas, scales.get("prfaas", 1.0)), pd=pd)
        return dataclasses.replace(self, deployment=dep)

    def _with_output(self, output_tokens: float | None) -> Deployment:
        dep = self.deployment
        return dep if output_tokens is None else dataclasses.replace(dep, output_tokens=max(output_tokens, 1.0))

    def plan_splits(self, workload: Workload, output_tokens: float | None = None) -> dict[int, OperatingPoint]:
        """Every PD split's best operating point on ``workload`` (and ``L_out``), nominal link: what the
        long-term controller chooses among (the planner's search, column by column)."""
        result = search(self._with_output(output_tokens), workload, self.step_tokens)
        return dict(zip(result.n_prefill_options, result.best_by_split, strict=True))

    def evaluate_at(self, workload: Workload, threshold_tokens: float, output_tokens: float | None = None) -> OperatingPoint:
        """Equation (6) at this split and ``t`` on ``workload``: the model's view of what runs now."""
        return evaluate(self._with_output(output_tokens), workload.split(threshold_tokens), self.n_prefill, self.n_decode)

    def research(self, capacity_bps: float | None, workload: Workload | None = None) -> float:
        return self.operating_point(capacity_bps, workload).threshold_tokens

    @property
    def baseline_threshold_tokens(self) -> float:
        """The operator's ``scheduler.threshold_tokens``, else the planner's t for the nominal link."""
        if self.operator_threshold_tokens is not None:
            return self.operator_threshold_tokens
        return self.research(None)

    def capacity_rps(self, threshold_tokens: float | None = None) -> float:
        """Lambda_max (requests/s, observed units) at ``t`` (default: the baseline)."""
        t = self.baseline_threshold_tokens if threshold_tokens is None else threshold_tokens
        return evaluate(self.deployment, self.prior.split(t), self.n_prefill, self.n_decode).lambda_max_rps

    def describe(self) -> dict:
        """What the model assumes, for ``/status`` and logs."""
        return {
            "instances": {"prfaas": self.deployment.n_prfaas, "pd_prefill": self.n_prefill, "pd_decode": self.n_decode},
            "cost": {k: c.source for k, c in self.costs.items()},
            "link_gbps": self.link_bps / 1e9, "kv_layerwise": self.layerwise,
            "workload_prior": getattr(self.prior, "name", type(self.prior).__name__),
            "output_tokens": self.output_tokens, "slo_tokens_per_s": self.slo_tokens_per_s, "ttft_slo_s": self.ttft_slo_s,
            "decode_bs_max": self.decode.bs_max,
            "emulation": dataclasses.asdict(self.emulation),
            "baseline_threshold_tokens": self.baseline_threshold_tokens,
            "defaults_used": list(self.defaults_used),
        }



@dataclass(frozen=True)
class PdClusterModel:
    """One PD cluster and every PrfaaS cluster linked to it: what its long-term controller plans the
    cluster's split on. ``pairs``: each pair's one-pair model (:func:`pair_models`), the PD cluster and its
    split the same in each. A request the cluster decodes may be prefilled on any of its PrfaaS clusters,
    so the plan pools them (:func:`~prfaas_sglang.plan.model.evaluate_pooled`: ``Theta_prfaas`` adds up over
    the links). A PrfaaS cluster shared with other PD clusters counts whole here, as it does in its pair
    models; the stage rates the controller measures (``ClusterSample.for_pd``: this cluster's share)
    show what it really gives. The cluster runs one ``t`` here: its pairs' lowest (a request longer than
    that may be offloaded over some link). On one pair every answer is that pair's model's."""

    pairs: Mapping[SitePair, RuntimeModel]

    def __post_init__(self):
        if not self.pairs:
            raise ValueError("a PD cluster's model needs at least one pair")
        if len({pair.pd for pair in self.pairs}) != 1:
            raise ValueError(f"pairs of several PD clusters: {', '.join(map(str, self.pairs))}")
        if len({(m.n_prefill, m.n_decode) for m in self.pairs.values()}) != 1:
            raise ValueError("the pairs of one PD cluster disagree on its split")

    @property
    def _pd_side(self) -> RuntimeModel:
        """A pair's model, for what every pair of the cluster shares: the PD cluster, its split, the scheduler."""
        return next(iter(self.pairs.values()))

    @property
    def n_prefill(self) -> int:
        return self._pd_side.n_prefill

    @property
    def n_decode(self) -> int:
        return self._pd_side.n_decode

    @property
    def n_pd(self) -> int:
        return self._pd_side.deployment.n_pd

    def with_split(self, n_prefill: int) -> PdClusterModel:
        """Every pair at ``n_prefill`` PD-P instances (:meth:`RuntimeModel.with_split`)."""
        return PdClusterModel({pair: m.with_split(n_prefill) for pair, m in self.pairs.items()})

    def calibrated(self, scales: Mapping[str, float]) -> PdClusterModel:
        """Every pair scaled by what was measured (:meth:`RuntimeModel.calibrated`)."""
        return PdClusterModel({pair: m.calibrated(scales) for pair, m in self.pairs.items()})

    def _deployments(self, output_tokens: float | None = None) -> list[Deployment]:
        return [m._with_output(output_tokens) for m in self.pairs.values()]

    def plan_splits(self, workload: Workload, output_tokens: float | None = None) -> dict[int, OperatingPoint]:
        """Every PD split's best operating point on ``workload`` (and ``L_out``), every link at its nominal
        capacity: what the long-term controller chooses among."""
        result = search_pooled(self._deployments(output_tokens), workload, self._pd_side.step_tokens)
        return dict(zip(result.n_prefill_options, result.best_by_split, strict=True))

    def evaluate_at(self, workload: Workload, threshold_tokens: float, output_tokens: float | None = None) -> OperatingPoint:
        """Equation (6), pooled, at this split and ``t`` on ``workload``: the model's view of what runs now."""
        return evaluate_pooled(self._deployments(output_tokens), workload.split(threshold_tokens), self.n_prefill,
                               self.n_decode)

    def prefill_rate(self, kind: str, tokens: float) -> float:
        """Requests/s one busy instance of ``kind`` (prfaas | pd) prefills, ``tokens`` each, by the model: a
        PD-P instance's, or the PrfaaS clusters' mean per instance (one cluster: its own)."""
        if kind == "pd":
            return 1.0 / self._pd_side.deployment.pd.prefill.prefill_s(tokens)
        sites = [(m.deployment.n_prfaas, 1.0 / m.deployment.prfaas.prefill.prefill_s(tokens)) for m in self.pairs.values()]
        if len(sites) == 1:
            return sites[0][1]
        return sum(n * rate for n, rate in sites) / max(sum(n for n, _ in sites), 1)

    def decode_rate(self, output_tokens: float) -> float:
        """Requests/s one full PD-D instance finishes at ``output_tokens`` each: ``BS_max / (T_decode L_out)``."""
        decode = self._pd_side.decode
        return decode.bs_max / (decode.step_s * output_tokens)


def pd_cluster_models(models: Mapping[SitePair, RuntimeModel]) -> dict[str, PdClusterModel]:
    """PD cluster -> the model of it and every PrfaaS cluster linked to it (``models``: :func:`pair_models`)."""
    by_pd: dict[str, dict[SitePair, RuntimeModel]] = {}
    for pair, model in models.items():
        by_pd.setdefault(pair.pd, {})[pair] = model
    return {pd: PdClusterModel(pairs) for pd, pairs in by_pd.items()}

def _link_bps(topology: Topology, defaults: list[str]) -> float:
    for link in topology.links:
        kinds = {topology.cluster_kinds.get(link.src), topology.cluster_kinds.get(link.dst)}
        if kinds == {"prfaas", "pd"}:
            return link.bandwidth_gbps * 1e9
    defaults.append("link")
    return DEFAULT_LINK_BPS


def _link_layerwise(topology: Topology) -> bool:
    """Whether the first PrfaaS <-> PD link (the one :func:`_link_bps` reads) streams KV by layer."""
    for link in topology.links:
        if {topology.cluster_kinds.get(link.src), topology.cluster_kinds.get(link.dst)} == {"prfaas", "pd"}:
            return link.layerwise
    return False


def _cluster_cost(topology: Topology, kind: str, catalog: Catalog, model_ref, workload: Workload,
                  output_tokens: int, slo: float, defaults: list[str]) -> ClusterCost:
    """One cost for every cluster of ``kind`` (the router's one-pair model: they must agree)."""
    specs = [c for c in topology.clusters.values() if c.kind == kind]
    profiled = [c for c in specs if c.profile or c.accelerator]
    if len({(c.profile, c.accelerator) for c in profiled}) > 1:
        raise ConfigError(f"clusters.{profiled[1].name}",
                          f"every {kind} cluster must use the same accelerator/profile: the router models one "
                          "PrfaaS-PD pair (`python -m prfaas_sglang.plan --topology` plans a fleet of several)")
    chosen = profiled[0] if profiled else None
    path = f"clusters.{specs[0].name}" if specs else f"clusters.<{kind}>"
    if chosen is None:
        defaults.append(f"{kind}.accelerator")
    return _spec_cost(chosen, kind, path, catalog, model_ref, workload, output_tokens, slo)


def _spec_cost(spec: ClusterSpec | None, kind: str, path: str, catalog: Catalog, model_ref, workload: Workload,
               output_tokens: int, slo: float) -> ClusterCost:
    """The cost of one cluster's instances: its measured profile, its accelerator, or the kind's default."""
    if spec is not None and spec.profile:
        data = catalog.load_yaml("profiles", spec.profile, f"{path}.profile")
        prefill, gpus, decode = parse_measured_profile(data, f"{path}.profile")
        if kind == "pd" and decode is None:
            raise ConfigError(f"{path}.profile", "a PD profile needs a decode section {bs_max, step_s}")
        return ClusterCost(kind, InstanceClass(prefill.name, gpus, prefill, decode), spec.profile, spec.profile,
                           measured_state(data, f"{path}.profile"))
    accel_name = spec.accelerator if spec is not None and spec.accelerator else DEFAULT_ACCELERATOR[kind]
    model = catalog.model(model_ref, "model.cost_model")
    accel = catalog.accelerator(accel_name, f"{path}.accelerator")
    decode = analytic_decode(model, accel, workload.mean_tokens, output_tokens, slo) if kind == "pd" else None
    ref = model_ref if isinstance(model_ref, str) else model.name
    return ClusterCost(kind, InstanceClass(accel.name, accel.gpus, AnalyticPrefill(model, accel), decode),
                       f"{ref}@{accel_name}", f"{model.name}@{accel.name} (analytic)",
                       state_kind(model))


def state_kind(model) -> str:
    """The state a model's prefix reuse stops at (pure): ``"recurrent"`` (linear attention: SGLang's
    Mamba cache), ``"swa"`` (sliding window), ``"recurrent+swa"``, or ``"none"`` (full attention only)."""
    kinds = [k for k, there in (("recurrent", model.recurrent), ("swa", model.sliding_window)) if there is not None]
    return "+".join(kinds) or "none"


@dataclass(frozen=True)
class ServiceTargets:
    """What the deployment promises its users, the same in every pair's model (``scheduler:``): the
    output length the planner assumes, the decode SLO and the TTFT SLO (model time)."""

    output_tokens: int
    slo_tokens_per_s: float
    ttft_slo_s: float


def service_targets(topology: Topology) -> ServiceTargets:
    """The topology's :class:`ServiceTargets`, each given or its default."""
    spec = topology.scheduler
    return ServiceTargets(spec.output_tokens or DEFAULT_OUTPUT_TOKENS, spec.slo_tokens_per_s or DEFAULT_SLO_TOKENS_PER_S,
                          spec.ttft_slo_s or DEFAULT_TTFT_SLO_S)


def _scheduler_inputs(topology: Topology, catalog: Catalog, defaults: list[str]):
    """(workload prior, L_out, decode SLO, cost model) from ``scheduler:`` and ``model:``, each input
    left to its default named in ``defaults``."""
    spec = topology.scheduler
    if spec.workload is not None:
        prior = parse_workload(spec.workload, catalog, "scheduler.workload")
    else:
        prior = CASE_STUDY_LENGTHS
        defaults.append("scheduler.workload")
    for given, name in ((spec.output_tokens, "scheduler.output_tokens"), (spec.slo_tokens_per_s, "scheduler.slo_tokens_per_s"),
                        (spec.ttft_slo_s, "scheduler.ttft_slo_s"), (topology.model.cost_model, "model.cost_model")):
        if given is None:
            defaults.append(name)
    targets = service_targets(topology)
    return prior, targets.output_tokens, targets.slo_tokens_per_s, topology.model.cost_model or DEFAULT_COST_MODEL


def from_topology(topology: Topology, catalog: Catalog | None = None, emulated: bool | None = None) -> RuntimeModel:
    """Build the runtime model; a bad or missing input raises :class:`ConfigError` naming its field.

    ``emulated``: the engines are emulated (scale costs by the ``emulation:`` section); None: they are
    when the topology has that section. The router passes what its workers report.
    """
    catalog = catalog or Catalog(base_dir=topology.base_dir or Path.cwd())
    defaults: list[str] = []
    spec = topology.scheduler
    prior, output_tokens, slo, model_ref = _scheduler_inputs(topology, catalog, defaults)

    count = {r: len(topology.nodes_of(r)) for r in (Role.PRFAAS, Role.PD_PREFILL, Role.PD_DECODE)}
    if count[Role.PD_DECODE] == 0:
        raise ConfigError("clusters", "the topology has no pd-decode node")
    if count[Role.PRFAAS] + count[Role.PD_PREFILL] == 0:
        raise ConfigError("clusters", "the topology has no prefill node")
    costs = {kind: _cluster_cost(topology, kind, catalog, model_ref, prior, output_tokens, slo, defaults)
             for kind in ("prfaas", "pd")}
    if emulated is None:
        emulated = topology.emulation is not None
    emulation = (topology.emulation or Emulation()) if emulated else Emulation()
    time_scale, kv_scale = 1.0 / emulation.speedup, emulation.kv_scale

    def observed(cost: ClusterCost) -> InstanceClass:
        decode = cost.instance.decode
        if decode is not None:
            bs_max = float(spec.decode_batch) if spec.decode_batch else decode.bs_max
            decode = DecodeProfile(bs_max, decode.step_s * time_scale,
                                   tuple((b, step_s * time_scale) for b, step_s in decode.batch_steps))
        return InstanceClass(cost.instance.name, cost.instance.gpus_per_instance,
                             ScaledPrefill(cost.instance.prefill, time_scale, kv_scale), decode)

    deployment = Deployment(observed(costs["prfaas"]), count[Role.PRFAAS], observed(costs["pd"]),
                            count[Role.PD_PREFILL] + count[Role.PD_DECODE], _link_bps(topology, defaults), output_tokens)
    return RuntimeModel(deployment, count[Role.PD_PREFILL], count[Role.PD_DECODE], prior, output_tokens, slo,
                        spec.threshold_step_tokens or DEFAULT_STEP_TOKENS, emulation, costs, spec.threshold_tokens,
                        tuple(defaults), service_targets(topology).ttft_slo_s, costs["pd"].state,
                        _link_layerwise(topology))


def pair_models(topology: Topology, catalog: Catalog | None = None, emulated: bool | None = None) -> dict[SitePair, RuntimeModel]:
    """The global scheduler's model of a topology: for each of its pairs (``Topology.pairs``: a PD
    cluster and a PrfaaS cluster linked to it), the one-pair model of that link, those two clusters
    and their own profiles and node counts (:func:`from_topology` of ``Topology.restricted``). Each
    link's threshold is planned on that link alone; a PrfaaS cluster serving several PD clusters is
    whole in each of its pairs, and its shared queue shows the router where it is busy. On a
    one-pair topology this is ``{the pair: from_topology(topology)}``."""
    catalog = catalog or Catalog(base_dir=topology.base_dir or Path.cwd())
    return {pair: from_topology(topology.restricted(pair), catalog, emulated) for pair in topology.pairs()}



def planned_capacity_rps(topology: Topology, catalog: Catalog | None = None) -> float:
    """Lambda_max of the deployment a topology describes, its PD splits as deployed, in model units (the
    ``emulation:`` section ignored). One pair: :meth:`RuntimeModel.capacity_rps` at its baseline t. A fleet:
    the fleet's linear program (``plan.fleet_model.evaluate_fleet``) at each PD cluster's split and the t it
    runs (its pairs' lowest baseline t, as :class:`PdClusterModel`), so a PrfaaS cluster that serves several
    PD clusters counts once, not once per pair."""
    models = pair_models(topology, catalog, emulated=False)
    if len(models) == 1:
        return next(iter(models.values())).capacity_rps()
    fleet, prior, _ = fleet_from_topology(topology, catalog)
    choices = {pd: PdChoice(min(m.baseline_threshold_tokens for m in cluster.pairs.values()), cluster.n_prefill)
               for pd, cluster in pd_cluster_models(models).items()}
    return evaluate_fleet(fleet, prior, choices).lambda_max_rps

def site_model(topology: Topology, site: str, catalog: Catalog | None = None) -> RuntimeModel:
    """The one-pair model of the first pair that holds cluster ``site``: its costs (``costs[kind]``), the
    emulation and the decode profile of its PD cluster are that cluster's. ConfigError for a cluster in
    no pair."""
    pair = next((p for p in topology.pairs() if site in (p.pd, p.prfaas)), None)
    if pair is None:
        raise ConfigError(f"clusters.{site}", "is in no PrfaaS-PD pair of the topology (no engine node, or no link)")
    return from_topology(topology.restricted(pair), catalog or Catalog(base_dir=topology.base_dir or Path.cwd()))


def fleet_from_topology(topology: Topology, catalog: Catalog | None = None) -> tuple[Fleet, Workload, float]:
    """The planner's view of a topology with any number of clusters, in model units (real accelerators'
    seconds and KV bytes: the ``emulation:`` section is ignored): every engine cluster with its own class
    and node count, every PrfaaS-PD link, the workload prior and the threshold grid's step."""
    catalog = catalog or Catalog(base_dir=topology.base_dir or Path.cwd())
    spec = topology.scheduler
    prior, output_tokens, slo, model_ref = _scheduler_inputs(topology, catalog, [])

    def cost(c: ClusterSpec) -> InstanceClass:
        instance = _spec_cost(c, c.kind, f"clusters.{c.name}", catalog, model_ref, prior, output_tokens, slo).instance
        if c.kind == "pd" and spec.decode_batch:
            instance = dataclasses.replace(instance, decode=dataclasses.replace(instance.decode, bs_max=float(spec.decode_batch)))
        return instance

    def count(c: ClusterSpec, *roles: Role) -> int:
        return sum(1 for n in topology.nodes if n.cluster == c.name and n.role in roles)

    prfaas = tuple(PrfaasSite(c.name, cost(c), count(c, Role.PRFAAS)) for c in topology.clusters.values() if c.kind == "prfaas")
    pd = tuple(PdSite(c.name, cost(c), count(c, Role.PD_PREFILL, Role.PD_DECODE), c.entry_share)
               for c in topology.clusters.values() if c.kind == "pd")
    links = []
    for link in topology.links:
        ends = {topology.cluster_kinds.get(link.src): link.src, topology.cluster_kinds.get(link.dst): link.dst}
        if set(ends) == {"prfaas", "pd"}:
            rtt_s = link.rtt_ms / 1e3 if link.rtt_ms is not None else None
            links.append(FleetLink(ends["prfaas"], ends["pd"], link.bandwidth_gbps * 1e9, rtt_s))
    return Fleet(prfaas, pd, tuple(links), output_tokens), prior, spec.threshold_step_tokens or DEFAULT_STEP_TOKENS


def engine_role_kind(role: Role) -> str:
    """``prfaas`` or ``pd``: whose cost profile an engine node of ``role`` runs."""
    return ROLE_SPECS[role].cluster_kind
