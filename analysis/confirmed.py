"""The answer: confirmation runs -> per-configuration statistics -> paired decisions -> recommendation, fairness.

Every number here is a dev number of confirmation runs (a record without them: search trials, marked). A
configuration (``config_key``) confirmed with S seeds has its seed mean, sample std and t-based 95% interval per
metric. The decisions are ``peftune.stats.decisions``'s, replayed on the record's decision-split predictions; the
recommendation per budget is the pick with its decision, P(best), the expected regret and the dev score, reported
only; ``own_rates`` replays the procedure on records simulated from this sweep's own variance components. The
fairness table gives per method the search budget it received, its default's score, its best tuned seed mean, the
tuning gain and the spread of its trials. The definitions the report quotes: docs/report.md, "The answer".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis import pareto
from peftune.base.record_names import (
    BACKBONE_PARAMS,
    BUDGETS_PCT,
    COMPLETED,
    DECISION,
    STORED_PARAMS_PCT,
    is_report_run,
    unique_labels,
)
from peftune.record import legacy
from peftune.stats import decisions, simulate
from peftune.stats.decisions import CANNOT_TELL, Configuration, Plan

ALPHA = 0.05
OWN_SIMULATIONS = 400  # per rate: a rate near 5% gets a Monte-Carlo interval of about +-2.2 points
OWN_RATE_COLUMNS = ["what", "rate", "mc_low", "mc_high", "hits", "simulations"]


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


# ----------------------------------------------------------------------------- configurations


def configurations(sweep) -> pd.DataFrame:
    """One row per configuration: seed statistics of every metric, the configuration's identity and cost.

    From the confirmation runs (``sweep.confirmations``, completed ones) when there are any; else each
    completed search trial is a configuration of one run. Columns: ``config_key``, ``method``, ``label``,
    ``size``, ``default``, ``source`` (confirmed | search), ``split`` (where its numbers come from: dev for
    confirmation runs, selection for search trials), ``seeds``, cost columns, ``search_score`` (the search
    trial's best selection score), and per metric ``<m>_mean``, ``_std``, ``_ci_low``, ``_ci_high``.
    """
    metrics = ["score", *sweep.task_metrics]
    confirmations = getattr(sweep, "confirmations", None)
    runs, source = (confirmations, "confirmed") if confirmations is not None and len(confirmations) else (None, None)
    if runs is not None:
        runs = runs[runs["status"] == COMPLETED]
    if runs is None or not len(runs):
        runs, source = pareto.eligible(sweep.trials), "search"
    runs = runs[runs["score"].notna()] if len(runs) else runs
    search = sweep.trials
    rows = []
    for key, everything in runs.groupby("config_key", sort=False):
        # a pick's report runs (fresh seeds after the decisions) give its reported dev score, and only that
        reporting = everything["seed_reason"].map(is_report_run) if "seed_reason" in everything else None
        group = everything[~reporting] if reporting is not None else everything
        reported = everything[reporting] if reporting is not None else everything.iloc[0:0]
        if not len(group):
            continue
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
            "carried": bool(same["carried_from"].fillna("").astype(bool).any()) if "carried_from" in same else False,
            "source": source,
            "seeds": len(group),
            "seeds_added": int((group["seed_reason"].fillna("") != "").sum()) if "seed_reason" in group else 0,
            "seed_reason": next((r for r in group.get("seed_reason", []) if isinstance(r, str) and r), ""),
            "split": first["split"] if "split" in group else "dev",
            pareto.COST: first[pareto.COST],
            pareto.COST_PCT: first[pareto.COST_PCT],
            STORED_PARAMS_PCT: first.get(STORED_PARAMS_PCT, math.nan),
            BACKBONE_PARAMS: first.get(BACKBONE_PARAMS, math.nan),
        }
        row["search_score"] = same["score"].max() if len(same) else math.nan
        for metric in metrics:
            stats = seed_stats(group[metric].tolist())
            row.update({f"{metric}_{k}": v for k, v in stats.items() if k != "n"})
        fresh = seed_stats(reported["score"].tolist()) if len(reported) else seed_stats([])
        row.update({"report_seeds": fresh["n"], "report_mean": fresh["mean"], "report_std": fresh["std"]})
        row.update({"report_ci_low": fresh["ci_low"], "report_ci_high": fresh["ci_high"]})
        rows.append(row)
    return pd.DataFrame(rows)


def decide(configs: pd.DataFrame, frame: pd.DataFrame, kinds: Mapping[str, str], plan: Plan) -> Decided:
    """The decision procedure (``peftune.stats.decisions.replay``, the one the confirmation ran) on the confirmation
    runs' decision-split predictions (``frame``: ``analysis.runs.load_predictions``'s rows of that split).
    Without such predictions (a record from before the decision split, or ``decision_examples: 0``) nothing is
    decided: every answer is "cannot tell", said as such."""
    configurations = [
        Configuration(r.config_key, r.method, float(r[pareto.COST_PCT]), bool(r.default))
        for _, r in configs.iterrows()
    ] if len(configs) else []  # fmt: skip
    rows = frame[frame["split"] == DECISION] if len(frame) and "split" in frame else frame.iloc[0:0]
    rows = rows.rename(columns={"config_key": "config"})
    values = decisions.values_from_frame(rows, kinds) if len(rows) else {}
    outcome = decisions.replay(values, configurations, plan)
    table = decisions.pair_table(outcome)
    labels = _labels(configs) if len(configs) else {}
    table = table.assign(
        key_a=table["a"], key_b=table["b"],
        a=table["a"].map(labels), b=table["b"].map(labels),
        budget=[b if b == "all" else budget_label(b) for b in table["budget"]],
    )  # fmt: skip
    return Decided(table, outcome)


def own_rates(decided: Decided, sims: int = OWN_SIMULATIONS) -> tuple[str, pd.DataFrame]:
    """The procedure's error rates and power at this sweep's own sizes, simulated from its own measured
    components (``peftune.stats.simulate.own_characteristics``): the world measured and one row per rate. Empty
    with the reason where nothing can be simulated."""
    empty = pd.DataFrame(columns=OWN_RATE_COLUMNS)
    outcome = decided.outcome
    if outcome is None or outcome.plan is None or len(outcome.final) < 2 or sims < 1:
        return "no decision data: nothing to simulate", empty
    sizes = [len(a.members) for a in outcome.answers]
    world, rates = simulate.own_characteristics(outcome.final, outcome.plan, sizes, sims)
    if world is None:
        return "no configuration has 2 seeds: the noise and seed variance cannot be measured", empty
    rows = []
    for r in rates:
        low, high = simulate.wilson(r.hits, r.n)
        what = r.what.removeprefix(f"{world.name} ")
        rows.append({"what": what, "rate": r.rate, "mc_low": max(low, 0.0), "mc_high": min(high, 1.0),
                     "hits": r.hits, "simulations": r.n})  # fmt: skip
    k = max(sizes, default=2)
    reach = simulate.reachable_margin(world, k, outcome.plan)
    said = (
        f"{world.describe()}; margin δ = {outcome.plan.margin:g}; the smallest margin these sizes reach within "
        f"{outcome.plan.max_seeds} seeds (80% power, K = {k}, a normal approximation): about {reach:.3f}"
    )
    return said, pd.DataFrame(rows, columns=OWN_RATE_COLUMNS)


@dataclass
class Decided:
    """The decision procedure's outcome and its pair table (``decisions.DECISION_COLUMNS`` + key_a, key_b)."""

    table: pd.DataFrame
    outcome: decisions.Outcome | None = None

    def pairs(self, budget: str) -> dict[tuple[str, str], dict]:
        """(sorted config keys) -> the pair's row in the family of ``budget`` (a budget label, or "all")."""
        if not len(self.table):
            return {}
        rows = self.table[self.table["budget"] == budget]
        return {tuple(sorted((r["key_a"], r["key_b"]))): r for r in rows.to_dict("records")}

    def answer(self, budget: float) -> decisions.Answer | None:
        if self.outcome is None:
            return None
        return next((a for a in self.outcome.answers if a.budget == budget), None)


def seed_mean_frontier(configs: pd.DataFrame, decided: Decided | None = None) -> pd.DataFrame:
    """The Pareto frontier of the dev seed means (cost up), each point with ``vs_cheaper``: its decision
    against the next cheaper frontier point, from the family of all configurations (decision split)."""
    front = _mean_frontier(configs)
    empty = {"vs_cheaper": "", "diff_vs_cheaper": math.nan, "ci_low": math.nan, "ci_high": math.nan}
    rows = [dict(empty) for _ in range(len(front))]
    found = decided.pairs("all") if decided is not None else {}
    for i in range(1, len(front)):
        key = front.iloc[i]["config_key"]
        hit = found.get(tuple(sorted((key, front.iloc[i - 1]["config_key"]))))
        if hit is not None:
            diff, low, high, word = _from_side(hit, key)
            rows[i] = {"vs_cheaper": word, "diff_vs_cheaper": diff, "ci_low": low, "ci_high": high}
    return front.assign(**{k: [r[k] for r in rows] for k in empty}) if len(front) else front.assign(**empty)


def recommendations(
    configs: pd.DataFrame,
    decided: Decided | None = None,
    budgets_pct: Sequence[float] = BUDGETS_PCT,
    seconds_per_run: float = math.nan,
    record_version: int = legacy.RECORD_VERSION,
) -> pd.DataFrame:
    """Per budget: the pick of the decision procedure (the cheapest configuration shown not worse than the best
    of the others under the budget by more than the margin; else the best), its decision (and the interval of
    the pick minus the best of the others: Hsu's comparisons with the best), P(best) and regret, all on
    the decision split; beside it the pick's dev score (dev chose nothing) and what would decide an open one."""
    by_key = configs.set_index("config_key") if len(configs) else configs
    rows = []
    for budget in budgets_pct:
        row = {"budget_pct": budget, "method": None, "label": None, "mean": math.nan, "std": math.nan, "seeds": 0}
        row |= {"trainable_pct": math.nan, "best": None, "best_mean": math.nan, "decision": "none fits"}
        row |= {"diff": math.nan, "ci_low": math.nan, "ci_high": math.nan, "level": math.nan, "p_best": math.nan}
        row |= {"regret": math.nan, "regret_high": math.nan, "needs": "", "look": 0, "dev_source": ""}
        row |= {"p_within": math.nan, "plan": ""}  # P(pick - best of the others >= -margin); the first look's plan
        row["open"] = False  # a claim made while a cheaper configuration's question is still open
        # where an earlier look made the pick's claim: that look and its interval (the row's is the last look's)
        row |= {"shown_look": 0, "shown_diff": math.nan, "shown_low": math.nan, "shown_high": math.nan}
        row["shown_level"] = math.nan
        plan = decided.outcome.plan if decided is not None and decided.outcome is not None else None
        row["margin"] = plan.margin if plan is not None else math.nan  # the words' delta
        a = decided.answer(budget) if decided is not None else None
        under = configs[configs[pareto.COST_PCT] <= budget] if len(configs) else configs
        if (a is None or a.pick is None) and len(under):  # nothing to decide on: the best dev mean, said as undecided
            best = _ranked(under).iloc[0]["config_key"]
            a = decisions.Answer(budget, list(under["config_key"]), best=best, pick=best)
            a.needs = legacy.undecided(record_version)
        if a is not None and a.pick is not None:
            pick, best = by_key.loc[a.pick], by_key.loc[a.best]
            fresh = int(pick.get("report_seeds", 0) or 0) > 0
            row |= {"method": pick["method"], "label": pick["label"], "trainable_pct": pick[pareto.COST_PCT]}
            if fresh:  # seeds that chose nothing: an unbiased dev score
                row |= {"mean": pick["report_mean"], "std": pick["report_std"], "seeds": int(pick["report_seeds"])}
                row["dev_source"] = "fresh seeds"
            else:  # the seeds that decided: their luck is in it (biased up where the pick was chosen among many)
                row |= {"mean": pick["score_mean"], "std": pick["score_std"], "seeds": int(pick["seeds"])}
                row["dev_source"] = "the decision seeds"
            row |= {"best": best["label"], "best_mean": best["score_mean"], "decision": a.decision}
            row["open"] = a.decision in (decisions.BETTER, decisions.NOT_WORSE) and not a.decided
            row |= {"diff": a.diff, "ci_low": a.ci_low, "ci_high": a.ci_high, "level": a.level}
            if (shown := a.shown_earlier) is not None:
                row |= {"shown_look": shown.look, "shown_diff": shown.diff, "shown_low": shown.low}
                row |= {"shown_high": shown.high, "shown_level": shown.level}
            row |= {"p_best": a.p_best.get(a.pick, math.nan), "regret": a.regret, "regret_high": a.regret_high}
            needs, plan_line = a.needs, a.plan
            for key, label in _labels(configs).items():  # keys to names, two frozen ones told apart
                needs, plan_line = needs.replace(str(key), label), plan_line.replace(str(key), label)
            row |= {"p_within": a.p_within, "plan": plan_line}
            row |= {"needs": needs + _cost_of(a, int(pick["seeds"]), seconds_per_run), "look": a.look}
        rows.append(row)
    return pd.DataFrame(rows)


def _cost_of(a: decisions.Answer, seeds: int, seconds_per_run: float) -> str:
    """What the seeds that would tell cost at this sweep's speed: ``seconds_per_run`` (a confirmation run's mean
    slot seconds) for the seeds each of the two configurations in question lacks."""
    if not a.seeds_needed or not math.isfinite(seconds_per_run):
        return ""
    runs = 2 * max(a.seeds_needed - seeds, 0)
    return f" ({runs} more runs: about {runs * seconds_per_run / 60:.0f} slot-minutes at this sweep's speed)"


def seconds_per_confirmation_run(sweep) -> float:
    """A completed confirmation run's mean slot seconds (training, evaluation, start-up); nan without one."""
    runs = sweep.confirmations if sweep.confirmations is not None else pd.DataFrame()
    done = runs[runs["status"] == COMPLETED] if len(runs) else runs
    if not len(done):
        return math.nan
    parts = [done[c].fillna(0.0) for c in ("train_time_s", "eval_total_s", "startup_s") if c in done]
    return float(sum(parts).mean()) if parts else math.nan


def budget_table(
    configs: pd.DataFrame, decided: Decided | None = None, budgets_pct: Sequence[float] = BUDGETS_PCT
) -> pd.DataFrame:
    """Per budget, every method's best configuration under it (by dev seed mean, shown), with its decision
    against the budget's best on the decision split (the budget's family): every method tried is in its rows."""
    rows = []
    for budget in budgets_pct:
        under = _ranked(configs[configs[pareto.COST_PCT] <= budget]) if len(configs) else configs
        if not len(under):
            continue
        a = decided.answer(budget) if decided is not None else None
        best_key = a.best if a is not None and a.best else under.iloc[0]["config_key"]
        found = decided.pairs(budget_label(budget)) if decided is not None else {}
        for _, r in under.drop_duplicates("method").iterrows():
            label = r["label"] + setting_mark(bool(r.get("default")), bool(r.get("carried")))
            row = {"budget_pct": budget, "method": r["method"], "label": label, "mean": r["score_mean"]}
            row |= {"std": r["score_std"], "seeds": int(r["seeds"]), "trainable_pct": r[pareto.COST_PCT]}
            hit = found.get(tuple(sorted((best_key, r["config_key"]))))
            diff, low, high, word = _from_side(hit, r["config_key"]) if hit else (math.nan,) * 3 + ("",)
            if r["config_key"] == best_key:
                word = "the best"
            rows.append(row | {"vs_best": word or CANNOT_TELL, "diff": diff, "ci_low": low, "ci_high": high})
    return pd.DataFrame(rows)


def budget_label(budget: float) -> str:
    return f"≤ {budget:g}%"


def _ranked(configs: pd.DataFrame) -> pd.DataFrame:
    """Best seed mean first; on a tie the cheaper."""
    return configs.sort_values(["score_mean", pareto.COST], ascending=[False, True], kind="stable")


def _mean_frontier(configs: pd.DataFrame) -> pd.DataFrame:
    """The configurations on the Pareto frontier of (seed mean up, cost down), cheapest first."""
    if not len(configs):
        return configs
    mask = pareto.pareto_mask(configs["score_mean"].to_numpy(float), configs[pareto.COST].to_numpy(float))
    return configs[mask].sort_values([pareto.COST, "score_mean"], ascending=[True, False]).copy()


def setting_mark(default: bool, carried: bool, tuned_beside: bool = False) -> str:
    """What a configuration's setting was, where the search did not tune it at that size: a method's default is
    its untuned setting (``tuned_beside``: it beat tuned trials of its size), a carried trial the method's tuned
    setting moved to this size (peftune.sweep.carry). Said so that no reader takes a default for the method tuned."""
    if default:
        return " (default, best of its size)" if tuned_beside else " (untuned default)"
    return " (tuned setting carried to this size)" if carried else ""


def _labels(configs: pd.DataFrame) -> dict[str, str]:
    """config_key -> its label, made unique where two configurations share one (``unique_labels``)."""
    return unique_labels(
        list(zip(configs["config_key"], configs["label"], configs["default"].astype(bool), strict=True))
    )


def _word(hit: Mapping, key: str) -> str:
    """The decision as said of ``key``'s side: "better" of the side that won; "worse" of the other."""
    if hit["decision"] == "better" and hit["key_a"] != key:
        return "worse"
    return hit["decision"]


def _from_side(hit: Mapping, key: str) -> tuple[float, float, float, str]:
    """(difference, interval low, high, word) of a decided pair, as ``key``'s score minus the other's."""
    if hit["key_a"] == key:
        return hit["diff_mean"], hit["ci_low"], hit["ci_high"], _word(hit, key)
    return -hit["diff_mean"], -hit["ci_high"], -hit["ci_low"], _word(hit, key)


def fairness(sweep, configs: pd.DataFrame, decided: Decided | None = None) -> pd.DataFrame:
    """One row per method: budget received, default, best tuned seed mean +- std, tuning gain (its interval
    and word where both were confirmed with predictions; shown also when it is <= 0), sensitivity."""
    gains = decided.pairs("all") if decided is not None else {}
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
        default_won = not len(tuned) and bool(len(confirmed_default))  # the search's best was the default itself
        tuned = confirmed_default if default_won else tuned
        best = tuned.loc[tuned["score_mean"].idxmax()] if len(tuned) else None
        gain = _gain(best, confirmed_default, gains)
        if default_won:  # one configuration on both sides: a gain of 0, said as such rather than left blank
            gain["gain_decision"] = DEFAULT_WON
        q1, q3 = (scored.quantile(0.25), scored.quantile(0.75)) if len(scored) else (math.nan, math.nan)
        rows.append(
            {
                "method": method,
                "trials": int(metrics.get(f"budget_trials.{method}", len(mine))),
                "steps": metrics.get(f"budget_steps.{method}", math.nan),
                "tokens": metrics.get(f"budget_tokens.{method}", math.nan),
                "compute_s": metrics.get(f"budget_compute_s.{method}", float(mine["train_time_s"].fillna(0).sum())),
                "default_score": default_score,
                "default_source": "confirmed" if len(confirmed_default) else ("search" if len(defaults) else ""),
                "tuned_label": best["label"] if best is not None else None,
                "tuned_mean": best["score_mean"] if best is not None else math.nan,
                "tuned_std": best["score_std"] if best is not None else math.nan,
                "tuned_seeds": int(best["seeds"]) if best is not None else 0,
                "tuning_gain": (best["score_mean"] - default_score) if best is not None else math.nan,
                **gain,
                "score_iqr": q3 - q1,
                "score_std": float(scored.std(ddof=1)) if len(scored) > 1 else math.nan,
            }
        )
    return pd.DataFrame(rows)


DEFAULT_WON = "the default won the search"


def _gain(best, confirmed_default: pd.DataFrame, gains: dict) -> dict:
    """The tuning gain's interval and word (tuned against default), where the comparison was made."""
    out = {"gain_ci_low": math.nan, "gain_ci_high": math.nan, "gain_decision": ""}
    if best is None or not len(confirmed_default):
        return out
    key_d = confirmed_default.iloc[0]["config_key"]
    hit = gains.get(tuple(sorted((best["config_key"], key_d))))
    if hit is None:
        return out
    diff, low, high, word = _from_side(hit, best["config_key"])  # tuned - default
    return {"gain_ci_low": low, "gain_ci_high": high, "gain_decision": word}


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


def interval_text(diff, low, high, digits: int = 3) -> str:
    """``+0.012 [-0.004, +0.028]``; the difference alone where no interval was computed."""
    if diff is None or pd.isna(diff):
        return ""
    if pd.isna(low) or pd.isna(high):
        return f"{diff:+.{digits}f}"
    return f"{diff:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def _pick_interval(r, level: str) -> str:
    """The pick's interval against the best of the others; where an earlier look made its claim, that look's
    interval first (the one that showed it), then the last look's: seeds added since for other questions can
    move it below -margin, and the claim stands (the looks' error rate covers it)."""
    last = interval_text(r.diff, r.ci_low, r.ci_high) + level
    if not getattr(r, "shown_look", 0):
        return last
    shown = interval_text(r.shown_diff, r.shown_low, r.shown_high) + f" at {r.shown_level:.2%}"
    return f"{shown} when shown, at look {r.shown_look}; {last} at look {r.look}, with the seeds added since"


def recommendation_display(table: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for r in table.itertuples(index=False):
        same = _text(r.best) == _text(r.label)
        level = "" if pd.isna(r.level) else f" at {r.level:.2%}"
        margin = getattr(r, "margin", math.nan)
        word = r.decision if pd.isna(margin) or r.decision in ("only one fits", "none fits") else (
            f"{r.decision} (δ = {margin:g})")  # fmt: skip
        if getattr(r, "open", False):  # the pick stands on what was answered; a cheaper one may yet be as good
            word += "; a cheaper question still open"
        rows.append(
            {
                "Budget (trainable/task)": f"≤ {r.budget_pct:g}%",
                "Pick": _text(r.label) or "none fits",
                "Decision (decision split)": word,
                "Trainable/task (%)": _pct(r.trainable_pct),
                "Dev score (mean ± std, reported only)": mean_std(r.mean, r.std),
                "Seeds (dev score's)": f"{r.seeds} ({r.dev_source})" if r.seeds else "",
                "Best under the budget": "the pick" if same else f"{_text(r.best)}, {r.best_mean:.3f}",
                "Pick - best of the others [simultaneous interval]": _pick_interval(r, level),
                "P(pick - best ≥ -δ)": "" if pd.isna(getattr(r, "p_within", math.nan)) else f"{r.p_within:.2f}",
                "P(best)": "" if pd.isna(r.p_best) else f"{r.p_best:.2f}",
                "Expected regret (95% bound)": "" if pd.isna(r.regret) else f"{r.regret:.3f} ({r.regret_high:.3f})",
                "What would decide it": _text(r.needs),
                "Plan (first look)": _text(getattr(r, "plan", "")),
            }
        )
    return pd.DataFrame(rows)


def budget_table_display(table: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for r in table.itertuples(index=False):
        rows.append(
            {
                "Budget": f"≤ {r.budget_pct:g}%",
                "Method": r.method,
                "Its best configuration": r.label,
                "Trainable/task (%)": _pct(r.trainable_pct),
                "Dev score (mean ± std)": mean_std(r.mean, r.std),
                "Seeds": r.seeds,
                "Vs the budget's best": r.vs_best,
                "Difference [simultaneous interval]": interval_text(r.diff, r.ci_low, r.ci_high),
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
                "Tokens": num(r.tokens, ",.0f"),
                "Compute s": num(r.compute_s, ",.0f"),
                "Best default": num(r.default_score, ".3f") + (f" ({r.default_source})" if r.default_source else ""),
                "Best tuned (mean ± std)": mean_std(r.tuned_mean, r.tuned_std),
                "Tuned configuration": _text(r.tuned_label),
                "Tuning gain [95% interval]": interval_text(r.tuning_gain, r.gain_ci_low, r.gain_ci_high),
                "Gain decision": r.gain_decision or ("" if pd.isna(r.tuning_gain) else CANNOT_TELL),
                "Spread: IQR": num(r.score_iqr, ".3f"),
                "Spread: std": num(r.score_std, ".3f"),
            }
        )
    return pd.DataFrame(rows)


def order_held(configs: pd.DataFrame, recommendation: pd.DataFrame) -> pd.DataFrame:
    """Per budget, how far the search's order held at the confirmation's budget: Spearman's rank correlation of
    the configurations' search scores (selection split, the search's fidelity) with their confirmed dev means
    (the confirmation's train rows and seeds), and the configurations the search ranked below the pick whose
    confirmed mean is above it. Empty without confirmation runs."""
    columns = ["budget_pct", "contenders", "rank_correlation", "moved_past_pick"]
    if not len(configs) or configs["source"].iloc[0] != "confirmed" or not len(recommendation):
        return pd.DataFrame(columns=columns)
    rows = []
    for r in recommendation.to_dict("records"):
        under = configs[configs[pareto.COST_PCT] <= r["budget_pct"]].dropna(subset=["search_score", "score_mean"])
        rho = under["search_score"].rank().corr(under["score_mean"].rank()) if len(under) >= 3 else math.nan
        pick = under[under["label"] == r["label"]]
        moved = ""
        if len(pick):
            p = pick.iloc[0]
            past = under[(under["search_score"] < p["search_score"]) & (under["score_mean"] > p["score_mean"])]
            moved = ", ".join(past["label"])
        rows.append({"budget_pct": r["budget_pct"], "contenders": len(under), "rank_correlation": rho,
                     "moved_past_pick": moved})  # fmt: skip
    return pd.DataFrame(rows, columns=columns)


def order_held_display(table: pd.DataFrame) -> pd.DataFrame:
    rho = ["–" if pd.isna(v) else f"{v:+.2f}" for v in table["rank_correlation"]]
    return pd.DataFrame({
        "Budget": [f"≤ {b:g}%" for b in table["budget_pct"]],
        "Confirmed configurations": table["contenders"],
        "Rank correlation, search vs confirmed": rho,
        "Ranked below the pick by the search, above it confirmed": table["moved_past_pick"].replace("", "none"),
    })  # fmt: skip


def configurations_display(front: pd.DataFrame, configs: pd.DataFrame, task_metrics: Sequence[str]) -> pd.DataFrame:
    """Every configuration, best first: mean ± std, 95% interval, seeds, frontier and within-noise marks."""
    if not len(configs):
        return pd.DataFrame()
    marks = dict(zip(front["config_key"], front["vs_cheaper"], strict=True)) if len(front) else {}
    rows = []
    for r in configs.sort_values("score_mean", ascending=False).to_dict("records"):
        row = {
            "Configuration": r["label"],
            "Trainable/task (%)": _pct(r[pareto.COST_PCT]),
            "Stored (%)": _pct(r.get(STORED_PARAMS_PCT)),
            "Score (mean ± std)": mean_std(r["score_mean"], r["score_std"]),
            "95% interval": ""
            if pd.isna(r["score_ci_low"])
            else f"[{r['score_ci_low']:.3f}, {r['score_ci_high']:.3f}]",
            "Seeds": r["seeds"]
            if not r.get("seeds_added")
            else f"{r['seeds']} ({r['seeds_added']} added: {r['seed_reason']})",
            "Search score (selection)": "" if pd.isna(r["search_score"]) else f"{r['search_score']:.3f}",
        }
        if len(task_metrics) > 1:
            for metric in task_metrics:
                row[metric] = mean_std(r[f"{metric}_mean"], r[f"{metric}_std"])
        key = r["config_key"]
        row["Frontier"] = ("yes" if key in marks else "") + (
            f", {marks[key]} than the cheaper point" if marks.get(key) in ("better", "worse") else
            f", {marks[key]} to the cheaper point" if marks.get(key) else ""
        )  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)
