"""Settings -> engine: the one place that turns ``TRIAGE_*`` into a ``Classifier``.

Every process that classifies builds through ``build_classifier``: the stream
worker, the RQ batch worker, ``eval`` / ``fit`` / ``verify`` and ``triage-bench``
(in-process modes, and its Redis mode through ``settings.settings_to_env``). So the
benchmark measures the worker's engine, not a hand-copied cousin of it. Variants
(a prompt-scoring eval, a bench thread count) are ``settings.model_copy(update=...)``
through the same builder.

Scorer choice (``TRIAGE_SCORER``):

* ``prompt``: label-token scoring (the engine's ``PromptScorer``).
* ``head``: the head in ``TRIAGE_HEAD_PATH`` (required); it must have been fitted for this
  model, prompt and label set, else start-up fails with the reason.
* ``auto`` (default): the head in ``TRIAGE_HEAD_PATH`` when set; else, for the built-in
  support task on a model the package ships a head for (``worker/heads``: bundled:smollm2,
  bundled:minilm, both joined), that shipped head, fitted on the project's labelled support
  tickets; else, when the task has at least one few-shot example for every label, a
  nearest-centroid head fitted at start-up on those examples' hidden states (one forward
  pass over a handful of examples, well under a second); else prompt scoring. Measured on
  real tickets heads beat label-token prompting by a wide margin (docs/quality.md).

Backbones: ``TRIAGE_MODEL`` may be a causal LM or an encoder (BERT family: a head is then
required); ``TRIAGE_ENCODER`` adds an encoder beside the LM (joined features, a head
required). A head reads the states of the prompt ``TRIAGE_HEAD_PROMPT`` names (``labels``:
instructions + label names, the default; ``task``: the whole task prompt); prompt scoring
always uses the whole task prompt.

``TRIAGE_CALIBRATION=contextual``: prompt scores are divided by the model's label
preference on content-free tickets (one tiny forward pass at start-up). A head's
probabilities are already fitted to data, so it is left alone (logged).

Heads and calibration are fitted through a prompt-scoring classifier; the final one
is built from it with ``with_scoring`` (same loaded model and prefix cache: cheap).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from worker.scorer_plan import ScorerPlan, ScoringConfigError, plan_scorer
from worker.settings import Settings, deprecated_env_in_use

if TYPE_CHECKING:
    from worker.engine.classifier import Classifier
    from worker.engine.loader import LoadedModel
    from worker.engine.scoring import Scorer
    from worker.engine.task import Task
    from worker.engine.types import EngineOptions

log = logging.getLogger("triage.assemble")

# Head fitted at start-up from task examples (a few per label): the centroid needs no
# regularisation choice and its probabilities were the best calibrated at 1-2 examples per label.
AUTO_METHOD, AUTO_POOLING = "centroid", "mean"

_warned: set[str] = set()


# ---------------------------------------------------------------------------- build
def build_classifier(
    settings: Settings,
    *,
    loaded: LoadedModel | None = None,
    task: Task | None = None,
    encoder: LoadedModel | None = None,
) -> Classifier:
    """The classifier these settings describe; ``loaded`` (and ``encoder``, for ``TRIAGE_ENCODER``) share already
    loaded models, ``task`` replaces the configured one (eval and bench prompt variants)."""
    from worker.engine.classifier import Classifier, backbone_name

    warn_deprecated_env()
    loaded, encoder = backbones(settings, loaded, encoder)
    task = task or task_from_settings(settings)
    check_task(settings, loaded, task)
    name = backbone_name(loaded, encoder)
    needs_head = loaded.kind != "decoder" or encoder is not None  # Classifier.needs_head, before there is one
    plan = plan_scorer(settings.scorer, settings.head_path, name, task, needs_head=needs_head)
    head_prompt = "task" if plan.kind == "prompt" else settings.head_prompt  # the prompt a head reads
    options = engine_options(settings, loaded.model.device)
    prompt = Classifier(loaded, task, options, encoder=encoder, head_prompt=head_prompt)
    scorer = choose_scorer(prompt, settings, plan)
    bias = calibration_bias(prompt, settings, scorer)
    from worker.engine import overhead

    clf = prompt if scorer is None and bias is None else prompt.with_scoring(scorer, bias)
    # TRIAGE_PASS_OVERHEAD_TOKENS=auto is timed on the classifier that serves; feature extraction (fit, eval)
    # has no scorer to time and plans with overhead.FALLBACK_TOKENS
    return overhead.resolve(clf, settings.pass_overhead_tokens)


def features_classifier(
    settings: Settings,
    *,
    loaded: LoadedModel | None = None,
    task: Task | None = None,
    encoder: LoadedModel | None = None,
) -> Classifier:
    """A classifier whose passes give the pooled states a head reads under these settings (``TRIAGE_MODEL``,
    ``TRIAGE_ENCODER``, ``TRIAGE_HEAD_PROMPT``), with no scorer chosen: what ``fit`` and ``eval`` fit heads on."""
    from worker.engine.classifier import Classifier

    loaded, encoder = backbones(settings, loaded, encoder)
    options = engine_options(prompt_scoring(settings), loaded.model.device)
    task = task or task_from_settings(settings)
    check_task(settings, loaded, task)
    return Classifier(loaded, task, options, encoder=encoder, head_prompt=settings.head_prompt)


def backbones(
    settings: Settings, loaded: LoadedModel | None = None, encoder: LoadedModel | None = None
) -> tuple[LoadedModel, LoadedModel | None]:
    """The model ``TRIAGE_MODEL`` names and the encoder ``TRIAGE_ENCODER`` joins (None without one), each
    loaded unless given. Loaded here with ``TRIAGE_DTYPE=auto``, both serve in one dtype: where one fell back from
    fp16 (``load``), the other is loaded in that dtype too (joined features, and the one dtype that names, caches
    and the bench's Redis mode carry)."""
    import torch

    from worker.engine.device import dtype_name

    def pinned_to(m: LoadedModel) -> Settings:
        return settings.model_copy(update={"dtype": dtype_name(m.model.dtype)})

    follows = loaded is None and settings.dtype == "auto"  # the LM loaded here: its dtype and the encoder's agree
    if loaded is None:
        loaded = load(settings)
    if encoder is None and settings.encoder:
        fell_back = follows and loaded.model.dtype != torch.float16  # (or CPU: the same measured dtype)
        encoder = load(pinned_to(loaded) if fell_back else settings, settings.encoder)
        if follows and encoder.model.dtype != loaded.model.dtype:  # the encoder fell back: the LM follows
            loaded = None  # its fp16 copy freed before the next load
            loaded = load(pinned_to(encoder))
    return loaded, encoder


def load(settings: Settings, name: str | None = None) -> LoadedModel:
    """Threads, device, dtype, weights: the one call of ``load_model`` (``name``: another model, e.g. the encoder).

    No hub calls once the model and the encoder (and ``name``) are all local or cached; while one of them needs
    the hub, it stays as the user set it (HF_HUB_OFFLINE), so that one can download.

    ``TRIAGE_DTYPE=auto`` picks fp16 on a GPU; a model whose outputs are not finite in fp16 (``dtype_check``: every
    ticket would be dead-lettered) is loaded again in bf16 (fp32 without it), logged (``dtype_fallback``). A dtype
    set by hand is kept."""
    import gc

    import torch

    from worker.engine.device import (
        DTYPES,
        dtype_name,
        pick_device,
        pick_dtype,
        pick_threads,
        pick_tokenize_threads,
        set_tokenize_threads,
    )
    from worker.engine.dtype_check import outputs_finite, safer_dtype
    from worker.engine.loader import load_model
    from worker.engine.sources import go_offline_if_local

    go_offline_if_local(settings.model, settings.encoder, name)
    device = pick_device(settings.device)
    if (threads := pick_threads(settings.torch_threads, device)) is not None:  # before the dtype probe
        torch.set_num_threads(threads)
    set_tokenize_threads(pick_tokenize_threads(settings.tokenize_threads))  # before anything tokenizes
    model = name or settings.model
    dtype = pick_dtype(device, settings.dtype)
    # auto's fp16 (a GPU) is probed, and the safer dtype then loaded and probed in turn; any other choice is kept
    tries = [dtype, DTYPES[safer_dtype(device)]] if settings.dtype == "auto" and dtype == torch.float16 else [dtype]
    for k, dtype in enumerate(tries):
        loaded = load_model(model, device, dtype, settings.cache_dir)
        if len(tries) == 1 or outputs_finite(loaded):
            return loaded
        if k + 1 < len(tries):
            instead, why = dtype_name(tries[k + 1]), "its outputs are not finite in fp16 (NaN or inf: past its range)"
            log.warning("dtype_fallback", extra={"model": model, "dtype": "fp16", "instead": instead, "why": why})
        del loaded  # this frame holds the only reference: the fp16 copy is freed before the next one loads
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    raise ValueError(f"{model}: its outputs are not finite in {dtype_name(dtype)} either (NaN or inf): broken weights?")


# Per-pass caps on a CUDA device when TRIAGE_PASS_* are not set: a window becomes a few large passes.
# 32k tokens of a 0.5B model are ~25 ms of H200 compute, long enough that launches and the host's
# per-pass work hide behind it; the overhead (2,048 token-equivalents, as measured on an H200 in
# issue #10) only steers the padded planner, packed passes have no padding to trade against.
GPU_PASS_DEFAULTS = {"pass_max_items": 2048, "pass_max_tokens": 32768, "pass_overhead_tokens": 2048}
# A window on CUDA when TRIAGE_WINDOW_MAX_ITEMS is not set: two passes' worth, so the window's reads and writes
# are amortised over thousands of tickets (TRIAGE_WINDOW_TARGET_S still bounds it by measured time).
GPU_WINDOW_MAX_ITEMS = 4096


def _on_cuda(device) -> bool:
    return device is not None and getattr(device, "type", str(device)) == "cuda"


def window_max_items(settings: Settings, device=None) -> int:
    """The most tickets a window may take: TRIAGE_WINDOW_MAX_ITEMS, or on CUDA the GPU default when it is not set."""
    if _on_cuda(device) and "window_max_items" not in settings.model_fields_set:
        return GPU_WINDOW_MAX_ITEMS
    return settings.window_max_items


def engine_options(settings: Settings, device=None) -> EngineOptions:
    """The engine's options from the settings; on CUDA, pass caps the user did not set get GPU defaults."""
    from worker.engine.overhead import FALLBACK_TOKENS
    from worker.engine.types import EngineOptions

    on_cuda = _on_cuda(device)
    caps = {k: getattr(settings, k) for k in GPU_PASS_DEFAULTS}
    if on_cuda:
        caps.update({k: v for k, v in GPU_PASS_DEFAULTS.items() if k not in settings.model_fields_set})
    if caps["pass_overhead_tokens"] == "auto":  # CUDA: the GPU default; elsewhere measured once the model is built
        caps["pass_overhead_tokens"] = GPU_PASS_DEFAULTS["pass_overhead_tokens"] if on_cuda else FALLBACK_TOKENS
    return EngineOptions(
        max_input_tokens=settings.max_input_tokens,
        truncate=settings.truncate,
        prefix_cache=settings.prefix_cache,
        **caps,
        confidence_threshold=settings.confidence_threshold,
        fallback_label=settings.fallback_label,
        attention=settings.attention,
        cuda_graphs=settings.cuda_graphs,
        lookahead=settings.pass_lookahead,
    )


def task_from_settings(settings: Settings) -> Task:
    """``TRIAGE_TASK_FILE``, else ``TRIAGE_LABELS``, else the built-in support-ticket task."""
    from worker.engine.task import default_task, load_task_file, task_from_labels

    if settings.task_file is not None:
        return load_task_file(settings.task_file)
    labels = settings.label_list()
    if labels is not None:
        return task_from_labels(labels)
    return default_task()


def check_task(settings: Settings, loaded: LoadedModel, task: Task) -> None:
    """Task text a causal LM's prompt would read as control tokens is refused, naming where it came from."""
    from worker.engine.task_text import check_task_text

    setting = "TRIAGE_TASK_FILE" if settings.task_file is not None else "TRIAGE_LABELS" if settings.labels else None
    check_task_text(loaded, task, setting, str(settings.task_file) if settings.task_file is not None else None)


def prompt_scoring(settings: Settings) -> Settings:
    """These settings with label-token scoring, no calibration, no threshold, truncation on (eval and fit
    measure / fit on the raw scores and hidden states)."""
    return settings.model_copy(
        update={
            "scorer": "prompt",
            "head_path": None,
            "calibration": "none",
            "confidence_threshold": 0.0,
            "truncate": True,
        }
    )


# --------------------------------------------------------------------------- scorer
def scorer_plan(clf: Classifier, settings: Settings) -> ScorerPlan:
    """``scorer_plan.plan_scorer`` for this classifier: the one rule of which scorer the settings pick."""
    return plan_scorer(settings.scorer, settings.head_path, clf.model_name, clf.task, needs_head=clf.needs_head)


def choose_scorer(clf: Classifier, settings: Settings, plan: ScorerPlan | None = None) -> Scorer | None:
    """The scorer ``settings.scorer`` asks for on ``clf`` (a prompt-scoring classifier); ``None`` = prompt scoring.
    ``plan``: ``scorer_plan(clf, settings)`` when already made."""
    if settings.scorer == "prompt" and settings.head_path is not None:
        log.warning("TRIAGE_HEAD_PATH is set but TRIAGE_SCORER=prompt: the head is not used")
    return carry_out(clf, plan or scorer_plan(clf, settings))


def carry_out(clf: Classifier, plan: ScorerPlan) -> Scorer | None:
    """The scorer ``plan`` names, loaded or fitted on ``clf``; a shipped head that does not fit falls back."""
    from worker.quality.head import HeadScorer

    if plan.kind == "head_file":
        return load_head_scorer(clf, plan.path)
    if plan.kind == "shipped_head":
        scorer = load_shipped_head(clf, plan.path)
        return scorer if scorer is not None else carry_out(clf, plan.fallback)
    if plan.kind == "unscorable":
        raise plan.error()
    if plan.kind == "task_examples":
        head = fit_head_on_task_examples(clf)
        _selected("task examples", head, examples=len(clf.task.examples), note="TRIAGE_SCORER=prompt: label tokens")
        return HeadScorer(head, device=clf.device, source="task examples")
    why = (
        f"no task examples for {list(plan.missing_examples)}: a head needs one per label"
        if plan.missing_examples
        else None
    )
    log.info(SCORER_EVENT, extra={"scorer": "prompt", **({"why": why} if why else {})})
    return None


SCORER_EVENT = "scorer_selected"  # one line per build: which scorer serves, and where its head came from


def _selected(source: str, head, **fields) -> None:
    fields = {"scorer": "head", "head": source, "method": head.method, "pooling": head.pooling, **fields}
    log.info(SCORER_EVENT, extra=fields)


def load_head_scorer(clf: Classifier, path: Path) -> Scorer:
    """Load a fitted head and check it fits ``clf``'s model, prompt and labels."""
    from worker.quality.head import Head, HeadScorer

    try:
        head = Head.load(path)
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types for corrupt files
        raise ScoringConfigError("TRIAGE_HEAD_PATH", f"cannot load scorer head {path}: {e}") from e
    head.check(clf)  # HeadMismatch (a ValueError) says what differs
    _selected(str(path), head, training_tickets=head.meta.get("n_train"))
    return HeadScorer(head.reordered(clf.labels), device=clf.device, source=str(path))


def load_shipped_head(clf: Classifier, path: Path) -> Scorer | None:
    """The packaged default head when it fits ``clf`` (model, prompt, labels); else ``None``, logged."""
    from worker.quality.head import Head, HeadMismatch, HeadScorer

    head = Head.load(path)
    try:
        head.check(clf)
    except HeadMismatch as e:
        log.info("shipped_head_not_used", extra={"head": path.name, "why": str(e)})
        return None
    _selected(f"shipped:{path.name}", head, model=clf.model_name, training_tickets=head.meta.get("n_train"))
    return HeadScorer(head.reordered(clf.labels), device=clf.device, source=f"shipped:{path.name}")


def fit_head_on_task_examples(clf: Classifier, method: str = AUTO_METHOD, pooling: str = AUTO_POOLING):
    """A head from the task's own few-shot examples, through the classifier's own forward pass."""
    from worker.quality.head import fit_head, head_meta

    feats, labels = task_example_features(clf)
    meta = head_meta(clf, "task examples")
    return fit_head(
        feats.pooled(pooling), labels, clf.labels, method=method, pooling=pooling, meta=meta, blocks=clf.feature_blocks
    )


def task_example_features(clf: Classifier):
    """The task's examples as a head fitted on them reads them (the worker at start-up, eval's row of that head):
    each cut to the ticket limit whatever TRIAGE_TRUNCATE says (an example is part of the task, not a ticket to
    refuse), one the model cannot read left out (``usable_examples``). Features and the kept examples' labels."""
    from worker.engine.framing import prepare
    from worker.engine.task_text import usable_examples
    from worker.quality.features import run_features

    examples = clf.task.examples
    items = prepare([e.text for e in examples], clf.framing, True, clf.aux_framing)
    keep = usable_examples(clf.task, items, "TRIAGE_TASK_FILE")
    feats = run_features(clf, [items[i] for i in keep], score=False, progress=False)
    return feats, [examples[i].label for i in keep]


def calibration_bias(clf: Classifier, settings: Settings, scorer: Scorer | None):
    """The score bias ``settings.calibration`` asks for (``None``: none), measured through ``clf`` (prompt scoring)."""
    if settings.calibration != "contextual":
        return None
    if scorer is not None and scorer.kind == "head":
        log.warning("TRIAGE_CALIBRATION=contextual applies to prompt scoring only; the head is used as fitted")
        return None
    from worker.quality.calibration import contextual_bias

    bias = contextual_bias(clf)
    log.info(
        "calibration_fitted",
        extra={"calibration": "contextual", "score_bias": dict(zip(clf.labels, bias.round(3).tolist()))},
    )
    return bias


def warn_deprecated_env() -> None:
    """Log each deprecated ``TRIAGE_*`` name in use, once per process (start-up builds the classifier)."""
    for old, new in deprecated_env_in_use().items():
        if old not in _warned:
            _warned.add(old)
            log.warning("%s is deprecated: use %s (the old name still works for now)", old, new)
