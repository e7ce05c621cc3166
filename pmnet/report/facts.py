""""What ran" (the pipeline's records and the loaded trials, readable) and "Missing results"
(failed and absent trials, absent key metrics, unpaired seeds)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from pmnet import stats
from pmnet.trial_id import grid_size


def _meta_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return str(value)


def _grid_from_meta(meta: Mapping[str, Any]) -> tuple[list[str] | None, list[int] | None]:
    """The expected conditions and seeds of pipeline.json's ``grid``
    (``{"conditions": [...], "seeds": [...]}``, ``pipelines.plan.grid_record``); None for
    each that it does not give."""
    grid = meta.get("grid")
    if not isinstance(grid, Mapping):
        return None, None
    try:
        conditions = (None if grid.get("conditions") is None
                      else [str(c) for c in grid["conditions"]])
        seeds = None if grid.get("seeds") is None else [int(s) for s in grid["seeds"]]
    except (TypeError, ValueError):
        return None, None
    return conditions, seeds


def missing_results(
    df: pd.DataFrame,
    conditions: Sequence[str],
    seeds: Sequence[int],
    comparisons: pd.DataFrame | None = None,
    key_metrics: Sequence[str] = ("updated_ltm", "forced_identity", "fresh_ltm",
                                  "mismatched_ltm", "seg2_stm", "mean_stm"),
    variants: Sequence[str] = ("",),
    expected_arms: Sequence[tuple[str, str]] | None = None,
) -> list[str]:
    """Human-readable lines: failed trials, absent trials, absent key metrics, unpaired seeds.

    The expected trials are ``conditions x variants x seeds``, or ``expected_arms x seeds``
    when ``expected_arms`` ((condition, variant) pairs) is given; a trial of a named variant
    is named by its arm (``<condition>-<variant>``, :func:`stats.by_arm`)."""
    lines = []
    failed = set()
    for rec in df.attrs.get("failed", []):
        arm = stats.arm_name(rec["condition"], rec.get("variant") or "")
        failed.add((arm, int(rec["seed"])))
        lines.append(
            f"failed trial: {arm} seed {rec['seed']} ({rec['file']}): {rec['error']}"
        )
    arms = stats.by_arm(df)
    present = set(zip(arms["condition"], arms["seed"].astype(int))) if not df.empty else set()
    expected = (expected_arms if expected_arms is not None
                else [(c, v) for c in conditions for v in variants])
    for condition, variant in expected:
        arm = stats.arm_name(condition, variant)
        absent = [s for s in seeds if (arm, s) not in present | failed]
        if absent:
            lines.append(f"no result: {arm} {stats._seed_word(absent)}")
    for arm in stats.ordered_conditions(arms["condition"]) if not df.empty else []:
        for metric in key_metrics:
            values = stats.seed_values(arms, arm, metric)
            rows = arms[arms["condition"] == arm]
            lacking = sorted(set(rows["seed"].astype(int)) - set(values.index))
            if lacking:
                lines.append(
                    f"metric missing: {arm} {metric} for {stats._seed_word(lacking)}"
                )
    if comparisons is not None and len(comparisons):
        for r in comparisons.to_dict("records"):
            if r["missing_seeds"] and r["n"] > 0:
                lines.append(f"unpaired seeds in '{r['label']}': {r['note']}")
    for warning in df.attrs.get("warnings", []):
        lines.append(f"ignored value: {warning}")
    return lines


def _minutes(seconds: Any) -> str | None:
    return f"{float(seconds) / 60:.1f} min" if isinstance(seconds, (int, float)) else None


def _variants_from_meta(meta: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{variant name: overrides} of a pipeline's grid with named variants (pipeline.json's
    ``grid.variants``, which ``pipelines.plan.grid_record`` writes whenever the grid has
    named variants); {} for a grid of the default variant only."""
    grid = meta.get("grid") if isinstance(meta.get("grid"), Mapping) else {}
    found = grid.get("variants")
    if not isinstance(found, Mapping):
        return {}
    out = {str(k): dict(v) if isinstance(v, Mapping) else {} for k, v in found.items()}
    return out if any(out) else {}


def _pipeline_facts(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What ran, readable: preset, grid, code, Phase-1 checkpoint, wall times, status (from
    the pipeline's records; every key that is there, none invented)."""
    facts: list[tuple[str, str]] = []
    if meta.get("status"):
        facts.append(("status", str(meta["status"])))
    if meta.get("preset"):
        why = f" ({meta['preset_reason']})" if meta.get("preset_reason") else ""
        facts.append(("preset", f"{meta['preset']}{why}"))
    space = meta.get("space") if isinstance(meta.get("space"), Mapping) else {}
    grid = meta.get("grid") if isinstance(meta.get("grid"), Mapping) else space
    variants = _variants_from_meta(meta)
    if grid.get("conditions") and grid.get("seeds"):
        n_k = len(space.get("phase1_seeds") or grid.get("phase1_seeds") or ())
        text = (f"{space.get('name', 'grid')}: "
                + grid_size(len(grid["conditions"]), len(grid["seeds"]), len(variants), n_k))
        if space:
            gpu = f" + {space['gpus_per_trial']:g} GPU" if space.get("gpus_per_trial") else ""
            text += (f"; {space.get('cpus_per_trial', 1):g} CPU{gpu} per trial, "
                     f"max_failures {space.get('max_failures', '?')}")
        facts.append(("grid", text))
    if variants:
        described = []
        for name, sets in variants.items():
            settings = ", ".join(f"{k}={v}" for k, v in sorted(sets.items()))
            described.append((name or "default") + (f" ({settings})" if settings else ""))
        facts.append(("variants", "; ".join(described)))
    if meta.get("overrides"):
        facts.append(("overrides (--set)", _meta_value(meta["overrides"])))
    if meta.get("git_commit"):
        dirty = " (with uncommitted changes)" if str(meta.get("git_dirty")) == "true" else ""
        facts.append(("code", f"git {str(meta['git_commit'])[:12]}{dirty}"))
    p1 = meta.get("phase1") if isinstance(meta.get("phase1"), Mapping) else {}
    sha = p1.get("sha256") or meta.get("phase1_sha256")
    if sha:
        text = f"sha256 {str(sha)[:12]}..."
        stm = (p1.get("metrics") or {}).get("mean_stm")
        if isinstance(stm, (int, float)):
            text += f"; test mean STM recall {stm:.2f}%"
        if _minutes(p1.get("train_time_s")):
            text += f"; trained in {_minutes(p1['train_time_s'])}"
        if p1.get("imported_from"):
            text += f"; imported from {p1['imported_from']} (`--phase1-from`), not trained here"
        facts.append(("Phase-1 checkpoint", text))
    many = meta.get("phase1_checkpoints")
    for k, info in sorted((many or {}).items(), key=lambda kv: int(kv[0])
                          if str(kv[0]).isdigit() else 0) if isinstance(many, Mapping) else ():
        if not isinstance(info, Mapping):
            continue
        text = f"sha256 {str(info.get('sha256'))[:12]}..."
        stm = (info.get("metrics") or {}).get("mean_stm")
        if isinstance(stm, (int, float)):
            text += f"; test mean STM recall {stm:.2f}%"
        if _minutes(info.get("train_time_s")):
            text += f"; trained in {_minutes(info['train_time_s'])}"
        if info.get("imported_from"):
            text += f"; imported from {info['imported_from']}"
        facts.append((f"Phase-1 checkpoint, phase1_seed {k}", text))
    timing = meta.get("timing") if isinstance(meta.get("timing"), Mapping) else {}
    p1_label = ("Phase-1 training (summed over the checkpoints trained here, which train side "
                "by side)" if isinstance(many, Mapping) and len(many) > 1 else "Phase-1 training")
    parts = [f"{label} {_minutes(timing.get(key))}" for key, label in (
        ("wall_s", "pipeline"), ("phase1_train_s", p1_label),
        ("stage2_wall_s", "Stage 2"), ("sum_trial_train_s", "summed trial training"))
        if _minutes(timing.get(key))]
    if parts:
        runs = len(timing.get("invocations") or [])
        if runs > 1:
            label = f"wall time (last of {runs} timed invocations)"
        elif timing.get("resumed"):  # an invocation that was killed wrote no timing
            label = ("wall time (this invocation, a resume: earlier ones that did not finish "
                     "are not timed; summed trial training counts them)")
        else:
            label = "wall time"
        facts.append((label, ", ".join(parts)))
    versions = meta.get("versions") if isinstance(meta.get("versions"), Mapping) else {}
    if versions:
        facts.append(("versions", ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))))
    if meta.get("tracking"):
        facts.append(("MLflow", str(meta["tracking"])))
    store = meta.get("store") if isinstance(meta.get("store"), Mapping) else {}
    if store:
        named = store.get("subsets") or {}
        text = f"{store.get('format', '?')} version {store.get('version', '?')}"
        if named:
            text += "; subsets " + "; ".join(
                f"{name}: phase1_seed {', '.join(str(k) for k in seeds)}"
                for name, seeds in named.items())
        facts.append(("store", text))
    return facts


def _one_sha_per_phase1_seed(df: pd.DataFrame) -> bool:
    """Whether the checkpoint hashes differ only between Phase-1 seeds: every trial has a
    Phase-1 seed, and each seed's trials share one sha256 (K intended checkpoints)."""
    if not stats.has_phase1_variance(df):
        return False
    seeds = pd.to_numeric(df[stats.PHASE1_SEED], errors="coerce")
    if seeds.isna().any():
        return False
    shas = df["phase1_sha256"].astype("string").fillna("")
    return bool((shas.groupby(seeds.to_numpy()).nunique() == 1).all())


def _run_facts(df: pd.DataFrame) -> list[tuple[str, str]]:
    facts = [("trials loaded", str(len(df)))]
    if df.empty:
        return facts
    facts.append(("conditions", ", ".join(stats.ordered_conditions(df["condition"]))))
    if stats.has_variant_results(df):
        names = sorted(set(df["variant"]), key=lambda v: (v != "", v))
        facts.append(("variants (from results)",
                      ", ".join(v or "default" for v in names)))
    facts.append(("seeds", ", ".join(str(s) for s in sorted(set(df["seed"].astype(int))))))
    phase1_seeds = stats.phase1_seeds(df)
    if phase1_seeds:
        facts.append(("Phase-1 seeds (from results)",
                      ", ".join(str(s) for s in phase1_seeds)
                      + (f" ({len(phase1_seeds)} Phase-1 checkpoints)"
                         if len(phase1_seeds) > 1 else "")))
    for col in ("preset", "phase1_sha256"):
        if col not in df.columns:
            continue
        values = sorted({str(v) for v in df[col].dropna()})
        if values:
            text = ", ".join(values)
            if col == "phase1_sha256" and len(values) > 1 and not _one_sha_per_phase1_seed(df):
                text += " (WARNING: trials come from different Phase-1 checkpoints)"
            facts.append((f"{col} (from results)", text))
    if all(c in df.columns for c in stats.DEVICE_COLUMNS):  # where the trials trained
        used = df[list(stats.DEVICE_COLUMNS)].fillna("not recorded").value_counts(sort=False)
        facts.append(("trained on (from results)", "; ".join(
            f"{device}, {precision}: {n} trial{'s' if n != 1 else ''}"
            for (device, precision), n in sorted(used.items()))))
    params = []
    for condition in stats.ordered_conditions(df["condition"]):
        if "trainable_params" not in df.columns:
            break
        rows = df[df["condition"] == condition]
        tp = rows["trainable_params"].dropna()
        tf = rows.get("trainable_fraction", pd.Series(dtype=float)).dropna()
        if tp.size:
            text = f"{condition}: {int(tp.iloc[0]):,}"
            if tf.size:
                text += f" ({100 * float(tf.iloc[0]):.3f}%)"
            params.append(text)
    if params:
        facts.append(("trainable parameters", "; ".join(params)))
    total = df["train_time_s"].dropna() if "train_time_s" in df.columns else pd.Series([])
    if total.size:
        facts.append(("summed Phase-2 train time", f"{float(total.sum()) / 3600:.2f} h"))
    return facts
