"""The four training stages (paper §5, appendix D.3) as data, and the pure train step that runs one.

A `Stage` says which parameter groups train (`models.trainable` names), which loss terms count
(`losses` names) with which `losses.combine` formula, and which D.1 template the input pipeline builds:

    stage    trainable                               loss                          template
    coe      lora                                    L_emp                         text context -> CoE
    ccl      cs                                      L_ccl (+ KL)                  as coe, gold reply forced
    ccl_units cs                                     L_ccl (+ KL)                  units only (no LLM)
    sac      sd, proj, added_rows                    L_sal + L_cls + signal CE     <Aud> <Vid> lines only
    overall  lora, cs, sd, proj, added_rows          L_oal                         text + <Aud><Vid>
    pipeline lora                                    L_emp                         the Pipeline baseline

The ablations of the paper are functions of a stage (`apply_ablations`), so a run's stage is always
data that can be printed, compared and stored with a checkpoint.

`ccl_units` is not one of the paper's stages: it pre-trains a CS whose blocks are all unit-aligned from the
units alone (`reads_llm=False`: the backbone never runs, so a step costs the CS's share of a ccl step), and
the ccl stage then refines it with r^t (docs/design.md "Units read in context").

The train step is one pure function of (trainable state, optimizer state, frozen state, batch, rng) for
`jax.jit` over `nnx.split` state: no NNX transforms, the graph definitions static. Gradients are taken with
respect to the trainable state only, so frozen parameters (the pretrained LLM, the original embedding rows,
other stages' modules) get no gradient, no optimizer state, and stay bit-identical.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import optax
from flax import nnx

from empatheia_jax.data.templates import TemplateSpec
from empatheia_jax.models.empatheia import Empatheia  # also registers the "cs", "sd", "proj" groups
from empatheia_jax.models.empatheia_config import EmpatheiaConfig
from empatheia_jax.models.trainable import trainable_filter
from empatheia_jax.train import losses

_HEAD_TERMS = {
    "cs": frozenset(losses.CCL_TERMS),
    "sd": frozenset(losses.SAL_TERMS + losses.CLS_TERMS),
}


@dataclasses.dataclass(frozen=True)
class Stage:
    """One training stage: what trains, on which losses, from which input template.

    name: the stage's name (a checkpoint folder and metric prefix). trainable_groups: `models.trainable`
    groups the optimizer updates. loss_terms: `losses` term names that count; terms of the `loss_stage`
    formula that are not listed enter as 0 (ablations). template_stage, use_coe, media_input,
    pipeline_baseline: the `templates.TemplateSpec` / `pipeline_config.PipelineConfig` fields.
    reads_llm: the forward runs the backbone; False: only the CS runs, from its units with r^t empty
    (`Empatheia.content_from_units`), so the stage may train only the CS on L_ccl and KL.
    """

    name: str
    trainable_groups: frozenset[str]
    loss_terms: tuple[str, ...]
    template_stage: str
    loss_stage: str
    use_coe: bool = True
    media_input: bool = True
    pipeline_baseline: bool = False
    reads_llm: bool = True

    def __post_init__(self):
        object.__setattr__(self, "trainable_groups", frozenset(self.trainable_groups))
        object.__setattr__(self, "loss_terms", tuple(self.loss_terms))
        if self.loss_stage not in losses.STAGE_TERMS:
            raise ValueError(f"loss_stage={self.loss_stage!r} not in {tuple(losses.STAGE_TERMS)}")
        unknown = [t for t in self.loss_terms if t not in losses.TERMS]
        if unknown:
            raise ValueError(f"unknown loss terms {unknown}; known: {losses.TERMS}")
        extra = [t for t in self.loss_terms if t not in losses.STAGE_TERMS[self.loss_stage]]
        if extra:
            raise ValueError(f"terms {extra} are not part of the {self.loss_stage!r} formula")
        if not self.reads_llm:
            beyond = sorted(self.trainable_groups - {"cs"}) + [
                t for t in self.loss_terms if t not in (*losses.CCL_TERMS, losses.KL)]
            if beyond:
                raise ValueError(f"stage {self.name!r} does not run the LLM (reads_llm=False), so it can "
                                 f"train only the CS on L_ccl and KL, not {beyond}")
        trainable_filter(self.trainable_groups)  # validates the group names
        self.template_spec()  # validates the template fields

    @property
    def heads(self) -> frozenset[str]:
        """Optional model heads ("cs", "sd") whose outputs this stage's losses read."""
        return frozenset(h for h, terms in _HEAD_TERMS.items() if terms & set(self.loss_terms))

    def template_spec(self, n_signal: int = 16) -> TemplateSpec:
        return TemplateSpec(stage=self.template_stage, use_coe=self.use_coe, media_input=self.media_input,
                            pipeline_baseline=self.pipeline_baseline, n_signal=n_signal)

    def pipeline_fields(self) -> dict[str, Any]:
        """The `pipeline_config.PipelineConfig` fields this stage fixes."""
        return {"stage": self.template_stage, "use_coe": self.use_coe, "media_input": self.media_input,
                "pipeline_baseline": self.pipeline_baseline}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["trainable_groups"] = sorted(self.trainable_groups)
        d["loss_terms"] = list(self.loss_terms)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Stage:
        return cls(**{**d, "trainable_groups": frozenset(d["trainable_groups"]),
                      "loss_terms": tuple(d["loss_terms"])})


_SAC = (*losses.SAL_TERMS, *losses.CLS_TERMS, losses.SIGNAL_CE, losses.KL)

STAGES: dict[str, Stage] = {
    "coe": Stage("coe", frozenset({"lora"}), (losses.EMP,), "coe", "coe"),
    "ccl": Stage("ccl", frozenset({"cs"}), (*losses.CCL_TERMS, losses.KL), "ccl", "ccl"),
    "ccl_units": Stage("ccl_units", frozenset({"cs"}), (*losses.CCL_TERMS, losses.KL), "ccl", "ccl",
                       reads_llm=False),
    "sac": Stage("sac", frozenset({"sd", "proj", "added_rows"}), _SAC, "sac", "sac"),
    "overall": Stage(
        "overall",
        frozenset({"lora", "cs", "sd", "proj", "added_rows"}),
        (losses.EMP, *losses.CCL_TERMS, *losses.SAL_TERMS, *losses.CLS_TERMS, losses.KL),
        "overall",
        "overall",
    ),
}
STAGE_ORDER: tuple[str, ...] = ("coe", "ccl", "sac", "overall")

# The paper's Pipeline baseline: LoRA on L_emp; the target is "Emotion/Profile/Response" text and the
# generators are driven from that text, so the model has no heads and no media input.
PIPELINE_BASELINE = Stage(
    "pipeline", frozenset({"lora"}), (losses.EMP,), "coe", "coe", pipeline_baseline=True
)


def get_stage(name: str) -> Stage:
    """A stage by name: one of `STAGES` or "pipeline"."""
    if name == PIPELINE_BASELINE.name:
        return PIPELINE_BASELINE
    try:
        return STAGES[name]
    except KeyError:
        known = (*STAGES, PIPELINE_BASELINE.name)
        raise ValueError(f"unknown stage {name!r}; expected one of {known}") from None


class StageSkipped(ValueError):
    """The ablations leave the stage nothing to do (e.g. `ccl` without CS); a run skips it."""


def apply_ablations(
    stage: Stage, *, no_coe: bool = False, no_media: bool = False, no_cs: bool = False, no_sd: bool = False
) -> Stage:
    """The stage under the paper's ablations (use the matching EmpatheiaConfig flags for the model).

    no_coe: the target is the bare reply (template only). no_media: no <Aud>/<Vid> input, the projections
    do not train; `sac` (whose input is only media) is skipped. no_cs: the cs group and the L_ccl terms go;
    `ccl` is skipped. no_sd: the sd group and the L_sal/L_cls terms go; `sac` is skipped (its signal tokens
    would feed nothing). Raises StageSkipped when only KL / signal-CE terms or no trainable group remain.
    """
    groups, terms = set(stage.trainable_groups), list(stage.loss_terms)
    changes: dict[str, Any] = {}
    if no_coe:
        changes["use_coe"] = False
    if no_media:
        if stage.template_stage == "sac":
            raise StageSkipped(f"stage {stage.name!r} reads only speech and video; w/o media it is skipped")
        groups.discard("proj")
        changes["media_input"] = False
    if no_cs:
        groups.discard("cs")
        terms = [t for t in terms if t not in losses.CCL_TERMS]
    if no_sd:
        groups.discard("sd")
        terms = [t for t in terms if t not in losses.SAL_TERMS + losses.CLS_TERMS]
    primary = [t for t in terms if t not in (losses.KL, losses.SIGNAL_CE)]
    if not groups or not primary:
        raise StageSkipped(f"stage {stage.name!r} has nothing left to train under these ablations")
    return dataclasses.replace(stage, trainable_groups=frozenset(groups), loss_terms=tuple(terms), **changes)


def stage_plan(**ablations: bool) -> list[Stage]:
    """The stages a run trains, in order, under `apply_ablations` keywords (skipped stages left out)."""
    out = []
    for name in STAGE_ORDER:
        try:
            out.append(apply_ablations(STAGES[name], **ablations))
        except StageSkipped:
            continue
    return out


# ----------------------------------------------------------------------------------------------------------
# Optimizer and train step
# ----------------------------------------------------------------------------------------------------------


def make_optimizer(model: Empatheia, stage: Stage, tx: optax.GradientTransformation) -> nnx.Optimizer:
    """`nnx.Optimizer` whose state covers only the parameters of `stage.trainable_groups`.

    Raises if a group selects no parameter of `model` (e.g. "cs" on a model built without CS), because a
    stage that silently trains nothing of what it names is a configuration error. Under a mesh, call this
    inside `jax.set_mesh(mesh)` so the optimizer state is created sharded like the parameters.
    """
    empty = [g for g in sorted(stage.trainable_groups) if not nnx.to_flat_state(
        nnx.state(model, trainable_filter([g])))]
    if empty:
        raise ValueError(f"stage {stage.name!r} trains groups {empty}, in which the model has no parameters")
    return nnx.Optimizer(model, tx, wrt=trainable_filter(stage.trainable_groups))


class StepGraphs(NamedTuple):
    """The static halves of `nnx.split` (hashable): pass as a static argument of `jax.jit`."""

    model: Any
    optimizer: Any


def split_for_step(
    model: Empatheia, optimizer: nnx.Optimizer, stage: Stage
) -> tuple[StepGraphs, nnx.State, nnx.State, nnx.State]:
    """(graphs, trainable, frozen, opt_state): the arguments `make_train_step`'s function takes."""
    graphdef, params, frozen = nnx.split(model, trainable_filter(stage.trainable_groups), ...)
    opt_graphdef, opt_state = nnx.split(optimizer)
    return StepGraphs(graphdef, opt_graphdef), params, frozen, opt_state


def merge_after_step(
    model: Empatheia, optimizer: nnx.Optimizer, params: nnx.State, opt_state: nnx.State
) -> None:
    """Writes a step's results back into the live model and optimizer objects."""
    nnx.update(model, params)
    nnx.update(optimizer, opt_state)


TrainStep = Callable[..., tuple[nnx.State, nnx.State, dict[str, jax.Array]]]


def apply_update(
    graphs: StepGraphs, params: nnx.State, frozen: nnx.State, opt_state: nnx.State, grads: nnx.State
) -> tuple[nnx.State, nnx.State]:
    """One optimizer update of `params` with `grads` (pure): (new params, new opt_state)."""
    model = nnx.merge(graphs.model, params, frozen, copy=True)  # copies: the inputs stay as they were
    optimizer = nnx.merge(graphs.optimizer, opt_state, copy=True)
    optimizer.update(model, grads)
    return nnx.state(model, optimizer.wrt), nnx.state(optimizer)


def trainable_state(model: Empatheia, stage: Stage) -> nnx.State:
    """The parameters `stage` trains (what its optimizer updates; `init.make_tx` reads their placement)."""
    return nnx.state(model, trainable_filter(stage.trainable_groups))


def trainable_paths(model: Empatheia, groups: Iterable[str]) -> set[tuple[str, ...]]:
    """Paths of the parameters that `groups` select (what an optimizer over them updates)."""
    state = nnx.state(model, trainable_filter(groups))
    return {tuple(str(p) for p in path) for path, _ in nnx.to_flat_state(state)}


# What `eval_stage(cfg, template)` accepts: the four stages and the Pipeline baseline.
TEMPLATES: tuple[str, ...] = (*STAGE_ORDER, PIPELINE_BASELINE.name)


class TemplateError(ValueError):
    """An evaluation template the model cannot be scored on (unknown, or removed by the model's ablations,
    e.g. sac for a model without media input); `empatheia eval` prints it as one line and exits 2."""


def eval_stage(cfg: EmpatheiaConfig, template: str | None = None) -> Stage:
    """The stage whose template and loss formula evaluate a model of this config.

    template None: overall under the model's ablations, or the Pipeline baseline for such a model (all of
    the model's outputs). A name of `TEMPLATES` (`empatheia eval` passes the stage the checkpoint was trained
    for, or --template): that stage under the model's ablations, so a coe checkpoint is scored on the CoE
    prompt and L_emp rather than on heads and placeholders it never trained; "pipeline" is the baseline.
    """
    if template is None:
        template = PIPELINE_BASELINE.name if cfg.pipeline_baseline else "overall"
    if template == PIPELINE_BASELINE.name:
        return PIPELINE_BASELINE
    if template not in STAGES:
        raise TemplateError(f"unknown evaluation template {template!r}; expected one of {TEMPLATES}")
    template = STAGES[template].template_stage  # ccl_units: its model is served, so scored, with r^t
    try:
        return apply_ablations(STAGES[template], no_coe=not cfg.use_coe,
                                      no_media=not cfg.media_input, no_cs=not cfg.has_cs,
                                      no_sd=not cfg.has_sd)
    except StageSkipped as e:
        raise TemplateError(f"template {template!r} cannot score this model: {e}") from e


__all__ = [
    "PIPELINE_BASELINE",
    "STAGES",
    "STAGE_ORDER",
    "Stage",
    "StageSkipped",
    "StepGraphs",
    "apply_ablations",
    "apply_update",
    "get_stage",
    "make_optimizer",
    "merge_after_step",
    "split_for_step",
    "stage_plan",
    "trainable_paths",
    "trainable_state",
]
