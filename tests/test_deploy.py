"""The deployment files under deploy/ are well formed, carry what their platform needs, and every
gossiprec command line in them parses with gossiprec's own command-line parser (a flag renamed in the
code breaks this test, not a user's cluster)."""

from __future__ import annotations

import argparse
import configparser
import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def _parser(command: str) -> argparse.ArgumentParser:
    """gossiprec's parser for one sub-command (``agent``, ``run``, ``spec``, ``keys``)."""
    from gossiprec.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]  # type: ignore[no-any-return]


def _gossiprec_commands(text: str) -> list[list[str]]:
    """Every ``gossiprec ...`` invocation in a shell text, as argv after ``gossiprec`` (shell
    substitutions such as ``$(cat /tmp/run-args)`` stand for the words ``gossiprec spec --me`` prints)."""
    out = []
    for part in re.split(r"&&|\|\||;|\||\n", text):
        words = shlex.split(part.replace("$(cat /tmp/run-args)", "--name gossiprec-0.gossiprec-0 --port 29400"),
                            posix=True, comments=True)
        while words and words[0] in ("exec", "then", "do"):
            words = words[1:]
        if words and words[0].endswith("gossiprec"):
            argv, skip = [], False
            for w in words[1:]:  # redirections are the shell's, not arguments
                if skip:
                    skip = False
                elif w in (">", "<", "2>", ">>"):
                    skip = True
                elif not w.startswith((">", "<", "2>")):
                    argv.append(w)
            out.append(argv)
    return out


def _check(argv: list[str]) -> argparse.Namespace:
    cmd = argv[0]
    if cmd == "run":
        rest = argv[1:argv.index("--")] if "--" in argv else argv[1:]
        return _parser("run").parse_args(rest + ["--", "true"])
    return _parser(cmd).parse_args(argv[1:])


def test_the_systemd_unit_runs_an_agent_the_cli_accepts() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "gossiprec-agent.service")
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    svc = unit["Service"]
    assert svc["Restart"] == "always" and svc["ExecReload"] == "/bin/kill -HUP $MAINPID"
    argv = shlex.split(svc["ExecStart"])
    assert argv[0].endswith("/gossiprec") and argv[1] == "agent"
    args = _check(argv[1:])
    assert args.job == "/etc/gossiprec/job.toml" and args.keyring == "/etc/gossiprec/keyring.json"
    assert args.port == 29400 and not args.insecure and args.control_socket.startswith("/run/gossiprec/")
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    # its install notes use the commands as they exist
    notes = [line[1:].strip() for line in (DEPLOY / "systemd" / "gossiprec-agent.service").read_text().splitlines()
             if line.startswith("#")]
    cmds = [c for line in notes for c in _gossiprec_commands(line)]
    assert {c[0] for c in cmds} >= {"spec", "keys"}
    for c in cmds:
        if c[0] == "keys" and c[1:2] == ["generate"]:
            continue
        _check(c)


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "gossiprec-job.yaml").read_text()) if d]


def test_the_kubernetes_job_has_its_service_secret_and_indexes() -> None:
    docs = {d["kind"]: d for d in _docs()}
    svc, job = docs["Service"], docs["Job"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 6
    assert spec["backoffLimitPerIndex"] == 0
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "keyring")
    volume = next(v for v in pod["volumes"] if v["name"] == "keyring")
    assert mount["readOnly"] and volume["secret"]["defaultMode"] == 0o400
    assert not any("KEY" in e["name"] and "KEYRING" not in e["name"] for e in container.get("env", []))
    script = " ".join(container["args"])
    hosts = re.search(r'--hosts "([^"]+)"', script)
    assert hosts is not None
    from gossiprec.agent.spec import expand_hostlist

    names = expand_hostlist(hosts.group(1))
    assert names == [f"{job['metadata']['name']}-{i}.{svc['metadata']['name']}" for i in range(spec["completions"])]
    spares = int(next(e["value"] for e in container["env"] if e["name"] == "GOSSIPREC_SPARES"))
    assert 0 < spares < spec["completions"]
    cmds = _gossiprec_commands(script.replace('"$GOSSIPREC_SPARES"', str(spares)).replace(
        '"$(hostname).gossiprec"', "gossiprec-0.gossiprec"))
    assert [c[0] for c in cmds] == ["spec", "run"]
    spec_args, run_args = _check(cmds[0]), _check(cmds[1])
    assert spec_args.me and spec_args.out == "/tmp/job.toml" and spec_args.resolve_wait > 0
    assert run_args.job == "/tmp/job.toml" and run_args.keyring == f"{mount['mountPath']}/keyring.json"


def test_the_slurm_script_runs_commands_the_cli_accepts() -> None:
    text = (DEPLOY / "slurm" / "gossiprec.sbatch").read_text()
    assert "#SBATCH --no-kill" in text and "--kill-on-bad-exit=0" in text and "srun --nodes=1" in text
    task = re.search(r"task='(.*?)'\n", text, re.S)
    assert task is not None
    body = (task.group(1).replace("\\\n", " ").replace('"$NPROC"', "2").replace('"$SPARES"', "1")
            .replace('"$BASE_PORT"', "29400").replace("$SPEC_ARGS", "").replace("$RUN_ARGS", "")
            .replace('"$WORKDIR/job.toml"', "/w/job.toml").replace("$args", "--name n1-0 --port 29400")
            .replace("args=$(", "").replace(") || exit 2", ""))
    cmds = _gossiprec_commands(body)
    assert [c[0] for c in cmds] == ["spec", "run"]
    spec_args, run_args = _check(cmds[0]), _check(cmds[1])
    assert spec_args.slurm and spec_args.me and run_args.job == "/w/job.toml"


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in DEPLOY.rglob("*") if p.is_file()))
def test_every_deploy_file_is_covered_here(path: str) -> None:
    assert path in {"deploy/systemd/gossiprec-agent.service", "deploy/kubernetes/gossiprec-job.yaml",
                    "deploy/slurm/gossiprec.sbatch", "deploy/README.md", "deploy/grafana/gossiprec.json"}, \
        f"{path}: add a check for it here"


# --- the Grafana dashboard -----------------------------------------------------------------------------
DASHBOARD = DEPLOY / "grafana" / "gossiprec.json"
PENDING: set[str] = set()
"""Metrics the dashboard shows that the agent does not export yet (none: every one is exported; a
name put here must leave once the agent exports it, see below)."""
# the series each metric type exposes (prometheus-client's text format; a counter's bare name is no series)
SERIES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
          "gauge": ("",), "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
                "unless", "inf", "nan"}


def _exported() -> set[str]:
    """Every series name an agent's metrics registry exposes (its collector fed a status with a value
    in every counter table, so that each family is there)."""
    pytest.importorskip("prometheus_client")
    from gossiprec.agent.metrics import AgentMetrics

    class Status:
        def control_status(self) -> dict[str, Any]:
            one = {"x": 1}
            view = {"epoch": 1, "members": [{"node": "a", "rank": 0}]}
            return {"live": 1, "known": 1, "view": view, "health": 0, "fenced": False,
                    "leaving": False, "transport": {"rejects": one, "counters": one}, "machine": one,
                    "agent": one, "control": one}

    from gossiprec.agent.recoveries import RecoveryMetrics

    metrics = AgentMetrics(Status())
    RecoveryMetrics(metrics._prom, metrics.registry)  # as the agent attaches them (agent.metrics.serve)
    names: set[str] = set()
    for fam in metrics.registry.collect():
        names |= {s.name for s in fam.samples}
        names |= {fam.name + suffix for suffix in SERIES.get(fam.type, ("",))}  # labelled, no child yet
    return names


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers, ranges,
    grouping clauses and Grafana variables are taken out, less function names and keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)
    return {m.group(1) for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", e)
            if not m.group(2) and m.group(1).lower() not in PROMQL_WORDS}


def _queries(dash: Any, where: str = "") -> list[tuple[str, str]]:
    """(where, PromQL) for every ``expr`` in the dashboard (panels, annotations) and the metric of every
    ``label_values(metric, label)`` variable query."""
    out: list[tuple[str, str]] = []
    if isinstance(dash, dict):
        title = dash.get("title") or dash.get("name") or ""
        here = f"{where}/{title}" if title else where
        for key, value in dash.items():
            if key == "expr" and isinstance(value, str):
                out.append((here, value))
            elif key == "definition" and isinstance(value, str):
                m = re.fullmatch(r"\s*label_values\(\s*([^,{)]+?)\s*(?:\{[^}]*\})?\s*,\s*\w+\s*\)\s*", value)
                assert m is not None, f"{here}: a variable query this test does not read: {value}"
                out.append((here, m.group(1)))
            else:
                out += _queries(value, here)
    elif isinstance(dash, list):
        for item in dash:
            out += _queries(item, where)
    return out


def _unknown(dash: Any, known: set[str]) -> dict[str, str]:
    """Metric -> where, for every metric a query names that is not in ``known``."""
    return {name: where for where, expr in _queries(dash) for name in promql_metrics(expr) if name not in known}


def test_promql_metrics_reads_names_not_functions_labels_or_variables() -> None:
    assert promql_metrics('histogram_quantile(0.99, sum by (le, phase) (increase(gossiprec_x_bucket'
                          '{instance=~"$instance", a="b(c)"}[$window])))') == {"gossiprec_x_bucket"}
    assert promql_metrics("sum(a_total) without (rank) / on (job) group_left (x) b offset 5m > bool 1e3") == \
        {"a_total", "b"}
    assert promql_metrics("max(gossiprec_epoch) and gossiprec_fenced unless c[$__rate_interval]") == \
        {"gossiprec_epoch", "gossiprec_fenced", "c"}


def test_the_dashboard_queries_only_metrics_the_agent_exports() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exported = _exported()
    assert {"gossiprec_fences_total", "gossiprec_views_installed_total", "gossiprec_epoch",
            "gossiprec_detection_seconds_bucket"} <= exported  # the registry was read
    assert not PENDING & exported, f"exported now, remove from PENDING: {sorted(PENDING & exported)}"
    queries = _queries(dash)
    assert len(queries) >= 25, len(queries)
    assert _unknown(dash, exported | PENDING) == {}
    used = {n for _, e in queries for n in promql_metrics(e)}
    assert PENDING <= used, f"PENDING names no panel shows: {sorted(PENDING - used)}"
    # a misspelt name is caught (the check can fail)
    bad = copy.deepcopy(dash)
    target = next(p for p in bad["panels"] if p["title"] == "Fences")["targets"][0]
    target["expr"] = target["expr"].replace("gossiprec_fences_total", "gossiprec_fence_total")
    assert set(_unknown(bad, exported | PENDING)) == {"gossiprec_fence_total"}


def test_the_dashboard_has_its_variables_and_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"]["uid"] == "${datasource}"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
    titles = " | ".join(p["title"] for p in panels).lower()
    for words in ("recoveries by action", "rto p50 / p99", "rto by phase", "lost steps", "per donor",
                  "step time per rank", "ms behind", "fences", "views installed"):
        assert words in titles, words
