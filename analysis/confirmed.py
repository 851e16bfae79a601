"""Seed means, noise and the answer: confirmation runs -> per-configuration statistics -> recommendation, fairness.

Definitions (the report quotes them):

- **Seed mean.** A configuration (``config_key``) confirmed with S seeds (``peftune.confirm``) has the
  mean, the sample standard deviation (ddof 1) and a 95% interval ``mean +- t(0.975, S-1) * std / sqrt(S)``
  of each metric at each run's best dev epoch. Without confirmation runs, a configuration is its one
  search trial (S = 1: no std, no interval).
- **Beyond noise.** A is better than B beyond noise when A's mean is higher and:
  with at least 2 seeds on both sides, Welch's t-test (unequal variances) rejects equal means at 5%
  (two-sided); otherwise (a single run on a side), when the gap exceeds 1.96 standard errors of the
  difference, each side's standard error being that of the metric on ``n`` dev examples: for an
  accuracy ``sqrt(p (1 - p) / n)`` (binomial), for a Pearson r ``(1 - r^2) / sqrt(n - 1)``, for the score
  (the mean of T task metrics) ``sqrt(sum se_i^2) / T``. Without the dev sizes the question is left
  open (``None``), never answered "yes".
- **Within noise** (frontier marking): a frontier point, sorted by cost, that is not better than the
  next cheaper frontier point beyond noise: its extra parameters buy nothing measurable.
- **Recommendation per budget.** Under each budget (0.1%, 1%, 10% of the backbone trained per task), the
  configuration with the highest seed mean, and the best configuration of any *other* method (the
  runner-up): does the winner beat it beyond noise?
- **Fairness per method.** Search trials, trial-steps and compute seconds the method received (the parent
  run's ``budget_trials.<m>``, ``budget_steps.<m>``, ``budget_compute_s.<m>``; else counted from the trials:
  trials, and the sum of their ``train_time_s``), the best default (control-arm) trial's score, the best
  tuned configuration's seed mean +- std, the tuning gain (tuned - default) and the sensitivity: the
  interquartile range and std of the completed search trials' scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis import pareto

BUDGETS_PCT = (0.1, 1.0, 10.0)
ALPHA = 0.05
Z = 1.959963984540054  # the normal 97.5% quantile


# ----------------------------------------------------------------------------- statistics


def interval_factor(n: int) -> float:
    """Half-width of the t-based 95% interval of a mean of ``n`` values, per unit of their sample std."""
    from scipy import stats

    return float(stats.t.ppf(1 - ALPHA / 2, n - 1) / math.sqrt(n)) if n > 1 else math.nan


def seed_stats(values: Sequence[float]) -> dict[str, float]:
    """n, mean, sample std and the t-based 95% interval of ``values`` (NaN where undefined)."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    n = len(x)
    mean = float(x.mean()) if n else math.nan
    std = float(x.std(ddof=1)) if n > 1 else math.nan
    half = interval_factor(n) * std
    return {"n": n, "mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half}


def welch_p(mean_a, std_a, n_a, mean_b, std_b, n_b) -> float:
    """Two-sided p-value of Welch's t-test for equal means (both sides need 2+ values)."""
    from scipy import stats

    if std_a == 0 and std_b == 0:
        return 1.0 if mean_a == mean_b else 0.0
    return float(
        stats.ttest_ind_from_stats(mean_a, std_a, n_a, mean_b, std_b, n_b, equal_var=False, alternative="two-sided")[1]
    )


def metric_se(metric: str, value: float, n: float | None) -> float:
    """Standard error of one run's ``metric`` measured on ``n`` dev examples (NaN when n is unknown)."""
    if n is None or not n or not math.isfinite(value) or (isinstance(n, float) and math.isnan(n)):
        return math.nan
    if metric.endswith("_pearson"):
        return (1 - min(value * value, 1.0)) / math.sqrt(max(n - 1, 1))
    p = min(max(value, 0.0), 1.0)
    return math.sqrt(p * (1 - p) / n)


def score_se(metrics: dict[str, float], dev_sizes: dict[str, float]) -> float:
    """Standard error of the score (mean of the task metrics) of one run: sqrt(sum se_i^2) / T."""
    errors = [metric_se(m, v, dev_sizes.get(m.split("_")[0])) for m, v in metrics.items()]
    if not errors or any(math.isnan(e) for e in errors):
        return math.nan
    return math.sqrt(sum(e * e for e in errors)) / len(errors)


def beats(a: pd.Series, b: pd.Series, metric: str = "score") -> tuple[bool | None, float, str]:
    """(A better than B beyond noise?, p-value or NaN, the rule used); None when noise cannot be judged."""
    mean_a, mean_b = a[f"{metric}_mean"], b[f"{metric}_mean"]
    if a["seeds"] >= 2 and b["seeds"] >= 2:
        p = welch_p(mean_a, a[f"{metric}_std"], a["seeds"], mean_b, b[f"{metric}_std"], b["seeds"])
        return bool(mean_a > mean_b and p < ALPHA), p, "Welch t-test, 5%"
    se_a = a[f"{metric}_std"] / math.sqrt(a["seeds"]) if a["seeds"] >= 2 else a[f"{metric}_se"]
    se_b = b[f"{metric}_std"] / math.sqrt(b["seeds"]) if b["seeds"] >= 2 else b[f"{metric}_se"]
    if not (math.isfinite(se_a) and math.isfinite(se_b)):
        return None, math.nan, "noise unknown (1 run, dev size not recorded)"
    se = math.hypot(se_a, se_b)
    if se == 0:
        return bool(mean_a > mean_b), math.nan, "binomial standard error"
    from scipy import stats

    z = (mean_a - mean_b) / se
    return bool(z > Z), float(2 * stats.norm.sf(abs(z))), "binomial standard error, 1.96 se"


# ----------------------------------------------------------------------------- configurations


def dev_sizes(sweep) -> dict[str, float]:
    """Task -> dev examples: the parent's ``dev_examples.<task>`` metrics, else the budget's ``max_dev_examples``."""
    metrics = getattr(sweep, "parent_metrics", {}) or {}
    cap = sweep.parent_params.get("max_dev_examples")
    out = {}
    for task in sweep.tasks:
        n = metrics.get(f"dev_examples.{task}")
        if n is None and isinstance(cap, (int, float)) and not isinstance(cap, bool):
            n = cap
        if n is not None:
            out[task] = float(n)
    return out


def configurations(sweep) -> pd.DataFrame:
    """One row per configuration: seed statistics of every metric, the configuration's identity and cost.

    From the confirmation runs (``sweep.confirmations``, completed ones) when there are any; else each
    completed search trial is a configuration of one run. Columns: ``config_key``, ``method``, ``label``,
    ``size``, ``default``, ``source`` (confirmed | search), ``seeds``, cost columns, ``search_score``
    (the search trial's best dev score), and per metric ``<m>_mean``, ``_std``, ``_ci_low``, ``_ci_high``,
    ``_se`` (one run's standard error on the dev set, for the rule without seeds).
    """
    metrics = ["score", *sweep.task_metrics]
    confirmations = getattr(sweep, "confirmations", None)
    runs, source = (confirmations, "confirmed") if confirmations is not None and len(confirmations) else (None, None)
    if runs is not None:
        runs = runs[runs["status"] == "completed"]
    if runs is None or not len(runs):
        runs, source = pareto.eligible(sweep.trials), "search"
    runs = runs[runs["score"].notna()] if len(runs) else runs
    search = sweep.trials
    sizes = dev_sizes(sweep)
    rows = []
    for key, group in runs.groupby("config_key", sort=False):
        first = group.iloc[0]
        same = search[search["config_key"] == key] if "config_key" in search else search.iloc[0:0]
        # the control arm is the search's default trial; a confirmation run's own tag is not trusted (runs
        # confirmed before that tag was fixed carry "true" for every configuration)
        tagged = same if len(same) and "default" in same else group
        row = {
            "config_key": key,
            "method": first["method"],
            "label": first["label"],
            "size": first["size"],
            "default": bool(tagged["default"].any()) if "default" in tagged else False,
            "source": source,
            "seeds": len(group),
            pareto.COST: first[pareto.COST],
            pareto.COST_PCT: first[pareto.COST_PCT],
            "backbone_params": first.get("backbone_params", math.nan),
        }
        row["search_score"] = same["score"].max() if len(same) else math.nan
        for metric in metrics:
            stats = seed_stats(group[metric].tolist())
            row.update({f"{metric}_{k}": v for k, v in stats.items() if k != "n"})
        one_run = {m: row[f"{m}_mean"] for m in sweep.task_metrics}
        row["score_se"] = score_se(one_run, sizes)
        for metric in sweep.task_metrics:
            row[f"{metric}_se"] = metric_se(metric, row[f"{metric}_mean"], sizes.get(metric.split("_")[0]))
        rows.append(row)
    return pd.DataFrame(rows)


def frontier(configs: pd.DataFrame, metric: str = "score") -> pd.DataFrame:
    """The Pareto frontier of the seed means (cost up) with ``within_noise_of``: the cheaper neighbour it does
    not beat beyond noise ("" when it does), ``p_vs_cheaper`` and ``noise_rule``."""
    if not len(configs):
        return configs.assign(within_noise_of=pd.Series(dtype=str))
    mask = pareto.pareto_mask(configs[f"{metric}_mean"].to_numpy(float), configs[pareto.COST].to_numpy(float))
    front = configs[mask].sort_values([pareto.COST, f"{metric}_mean"], ascending=[True, False]).copy()
    marks, pvalues, rules = [""], [math.nan], [""]
    for i in range(1, len(front)):
        better, p, rule = beats(front.iloc[i], front.iloc[i - 1], metric)
        marks.append("" if better else front.iloc[i - 1]["label"] if better is False else "unknown")
        pvalues.append(p)
        rules.append(rule)
    return front.assign(within_noise_of=marks, p_vs_cheaper=pvalues, noise_rule=rules)


def recommendations(configs: pd.DataFrame, budgets_pct: Sequence[float] = BUDGETS_PCT) -> pd.DataFrame:
    """Per budget: the best configuration under it (seed mean), the runner-up of another method, beyond noise?"""
    rows = []
    for budget in budgets_pct:
        under = configs[configs[pareto.COST_PCT] <= budget] if len(configs) else configs
        row = {"budget_pct": budget, "method": None, "label": None, "mean": math.nan, "std": math.nan, "seeds": 0}
        row.update({"runner_up": None, "runner_up_mean": math.nan, "runner_up_std": math.nan})
        row.update({"beats_runner_up": None, "p_value": math.nan, "noise_rule": ""})
        if len(under):
            ranked = under.sort_values(["score_mean", pareto.COST], ascending=[False, True], kind="stable")
            best = ranked.iloc[0]
            row.update(
                method=best["method"],
                label=best["label"],
                mean=best["score_mean"],
                std=best["score_std"],
                seeds=int(best["seeds"]),
                trainable_pct=best[pareto.COST_PCT],
            )
            others = ranked[ranked["method"] != best["method"]]
            if len(others):
                second = others.iloc[0]
                better, p, rule = beats(best, second)
                row.update(
                    runner_up=second["label"],
                    runner_up_mean=second["score_mean"],
                    runner_up_std=second["score_std"],
                    beats_runner_up=better,
                    p_value=p,
                    noise_rule=rule,
                )
        rows.append(row)
    return pd.DataFrame(rows)


def fairness(sweep, configs: pd.DataFrame) -> pd.DataFrame:
    """One row per method: budget received, best default, best tuned seed mean +- std, tuning gain, sensitivity."""
    trials = sweep.trials
    metrics = getattr(sweep, "parent_metrics", {}) or {}
    rows = []
    for method in pareto.ordered_methods(trials["method"]) if len(trials) else []:
        mine = trials[trials["method"] == method]
        scored = pareto.eligible(mine)["score"].dropna()
        defaults = mine[mine["default"]] if "default" in mine else mine.iloc[0:0]
        default_score = defaults["score"].max() if len(defaults) else math.nan
        own = configs[(configs["method"] == method)] if len(configs) else configs
        tuned = own[~own["default"]] if len(own) else own
        confirmed_default = own[own["default"]] if len(own) else own
        if len(confirmed_default):  # the control arm confirmed too: compare seed means on both sides
            default_score = confirmed_default["score_mean"].max()
        best = tuned.loc[tuned["score_mean"].idxmax()] if len(tuned) else None
        q1, q3 = (scored.quantile(0.25), scored.quantile(0.75)) if len(scored) else (math.nan, math.nan)
        rows.append(
            {
                "method": method,
                "trials": int(metrics.get(f"budget_trials.{method}", len(mine))),
                "steps": metrics.get(f"budget_steps.{method}", math.nan),
                "compute_s": metrics.get(f"budget_compute_s.{method}", float(mine["train_time_s"].fillna(0).sum())),
                "default_score": default_score,
                "default_source": "confirmed" if len(confirmed_default) else ("search" if len(defaults) else ""),
                "tuned_label": best["label"] if best is not None else None,
                "tuned_mean": best["score_mean"] if best is not None else math.nan,
                "tuned_std": best["score_std"] if best is not None else math.nan,
                "tuned_seeds": int(best["seeds"]) if best is not None else 0,
                "tuning_gain": (best["score_mean"] - default_score) if best is not None else math.nan,
                "score_iqr": q3 - q1,
                "score_std": float(scored.std(ddof=1)) if len(scored) > 1 else math.nan,
            }
        )
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- display


def mean_std(mean, std, digits: int = 3) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return ""
    if std is None or (isinstance(std, float) and math.isnan(std)):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _pct(value) -> str:
    return "" if value is None or pd.isna(value) else f"{value:.3g}"


def _text(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _yes_no(value) -> str:
    return "yes" if value is True else "no (within noise)" if value is False else "unknown"


def recommendation_display(table: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for r in table.itertuples(index=False):
        rows.append(
            {
                "Budget (trainable/task)": f"≤ {r.budget_pct:g}%",
                "Best method": _text(r.method) or "none fits",
                "Configuration": _text(r.label),
                "Trainable/task (%)": _pct(getattr(r, "trainable_pct", None)),
                "Dev score (mean ± std)": mean_std(r.mean, r.std),
                "Seeds": r.seeds or "",
                "Runner-up (another method)": _text(r.runner_up) or "no other method fits",
                "Runner-up score": mean_std(r.runner_up_mean, r.runner_up_std),
                "Beats runner-up beyond noise": _yes_no(r.beats_runner_up) if _text(r.runner_up) else "",
                "p": "" if pd.isna(r.p_value) else f"{r.p_value:.3g}",
            }
        )
    return pd.DataFrame(rows)


def fairness_display(table: pd.DataFrame) -> pd.DataFrame:
    def num(value, fmt):
        return "" if value is None or pd.isna(value) else format(value, fmt)

    rows = []
    for r in table.itertuples(index=False):
        rows.append(
            {
                "Method": r.method,
                "Trials": r.trials,
                "Steps": num(r.steps, ",.0f"),
                "Compute s": num(r.compute_s, ",.0f"),
                "Best default": num(r.default_score, ".3f") + (f" ({r.default_source})" if r.default_source else ""),
                "Best tuned (mean ± std)": mean_std(r.tuned_mean, r.tuned_std),
                "Tuned configuration": _text(r.tuned_label),
                "Tuning gain": num(r.tuning_gain, "+.3f"),
                "Spread: IQR": num(r.score_iqr, ".3f"),
                "Spread: std": num(r.score_std, ".3f"),
            }
        )
    return pd.DataFrame(rows)


def configurations_display(front: pd.DataFrame, configs: pd.DataFrame, task_metrics: Sequence[str]) -> pd.DataFrame:
    """Every configuration, best first: mean ± std, 95% interval, seeds, frontier and within-noise marks."""
    if not len(configs):
        return pd.DataFrame()
    marks = dict(zip(front["config_key"], front["within_noise_of"], strict=True)) if len(front) else {}
    rows = []
    for r in configs.sort_values("score_mean", ascending=False).to_dict("records"):
        row = {
            "Configuration": r["label"],
            "Trainable/task (%)": _pct(r[pareto.COST_PCT]),
            "Score (mean ± std)": mean_std(r["score_mean"], r["score_std"]),
            "95% interval": ""
            if pd.isna(r["score_ci_low"])
            else f"[{r['score_ci_low']:.3f}, {r['score_ci_high']:.3f}]",
            "Seeds": r["seeds"],
            "Search score": "" if pd.isna(r["search_score"]) else f"{r['search_score']:.3f}",
        }
        if len(task_metrics) > 1:
            for metric in task_metrics:
                row[metric] = mean_std(r[f"{metric}_mean"], r[f"{metric}_std"])
        key = r["config_key"]
        row["Frontier"] = ("yes" if key in marks else "") + (
            f", within noise of {marks[key]}" if marks.get(key) not in (None, "", "unknown") else ""
        )
        rows.append(row)
    return pd.DataFrame(rows)
