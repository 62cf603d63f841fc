#!/usr/bin/env bash
# The package as users install it (`make smoke`, run by CI): build the sdist and the wheel with
# `python -m build`, install the wheel WITHOUT extras in a fresh virtual environment (torch pinned
# first, as the README says), and use it from a folder outside the checkout:
#   import storch, the README's example (its printed line checked), `storch-bench list`, a 20-step
#   `storch-bench` run on the bundled digits, `python -m storch.demo --help`, and the one-line
#   messages of the optional parts (tqdm, matplotlib, entmax) instead of tracebacks.
# Also checked: the sdist holds LICENSE, README.md (and CHANGELOG.md when the checkout has one),
# the wheel holds the bundled data and the licence, the metadata names the licence and the core
# pulls in nothing but torch and numpy (and what they need).
#
# Environment: PYTHON (default python3), TORCH (default torch==2.13.0), KEEP=1 keeps the scratch
# folder and prints its path.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
# the scratch folder (two virtual environments, about 1 GB) in memory where there is room: writing
# and deleting torch's files on a slow disk takes longer than the rest of the test
parent=${TMPDIR:-/tmp}
if [ -d /dev/shm ] && [ -w /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR == 2 { print $4 }')" -gt 3000000 ]; then
    parent=/dev/shm
fi
SCRATCH=$(mktemp -d "$parent/storch-smoke.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then echo "scratch folder: $SCRATCH"; else trap 'rm -rf "$SCRATCH"' EXIT; fi
start=$SECONDS
step() { printf '\n== %s (%ds)\n' "$1" $((SECONDS - start)); }
fail() { echo "wheel smoke test FAILED: $*" >&2; exit 1; }
# pip install, quiet but for the lines about index folders that this machine's pip configuration
# names and lacks
pip_install() { local py=$1; shift; "$py" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

step "build the sdist and the wheel (python -m build)"
"$PYTHON" -m venv "$SCRATCH/build-venv"
pip_install "$SCRATCH/build-venv/bin/python" build
# from a copy of the tracked and new files, so that nothing built lands in the checkout
mkdir "$SCRATCH/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$SCRATCH/src"
"$SCRATCH/build-venv/bin/python" -m build -q --outdir "$SCRATCH/dist" "$SCRATCH/src" >"$SCRATCH/build.log" 2>&1 \
    || { cat "$SCRATCH/build.log"; fail "python -m build"; }
ls -l "$SCRATCH/dist"
SDIST=$(ls "$SCRATCH"/dist/storch-*.tar.gz)
WHEEL=$(ls "$SCRATCH"/dist/storch-*.whl)

step "what the sdist and the wheel hold"
"$PYTHON" - "$SDIST" "$WHEEL" "$ROOT" <<'EOF'
import sys, tarfile, zipfile
from pathlib import Path
sdist, wheel, root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
wanted = ["LICENSE", "README.md", "pyproject.toml", "storch/_data/digits.npz", "storch/_data/README.md"]
wanted += ["CHANGELOG.md"] if (root / "CHANGELOG.md").is_file() else []
missing = [n for n in wanted if n not in names]
assert not missing, f"the sdist lacks {missing}"
whl = zipfile.ZipFile(wheel).namelist()
for n in ("storch/_data/digits.npz", "storch/py.typed", "storch/bench/cli.py"):
    assert n in whl, f"the wheel lacks {n}"
assert any(n.endswith(".dist-info/licenses/LICENSE") for n in whl), "the wheel lacks its LICENSE"
assert not any(n.startswith(("tests/", "docs/", "benchmarks/")) for n in whl), "the wheel holds more than storch"
print(f"sdist: {len(names)} files, {', '.join(wanted)} among them; wheel: {len(whl)} files")
EOF

step "a fresh virtual environment: pip, then $TORCH, then the wheel without extras"
"$PYTHON" -m venv "$SCRATCH/venv"
VPY="$SCRATCH/venv/bin/python"
# pip >= 25.1 shows the SPDX licence (License-Expression) in `pip show`
pip_install "$VPY" --upgrade "pip>=25.1"
pip_install "$VPY" --no-compile "$TORCH"  # no .pyc for all of torch: what is imported compiles when it is
pip_install "$VPY" "$WHEEL"
"$VPY" -m pip show storch | tee "$SCRATCH/show.txt"
grep -q "^License-Expression: MIT$" "$SCRATCH/show.txt" || fail "pip show names no licence"
"$VPY" -m pip list --format=freeze >"$SCRATCH/freeze.txt"
for extra in tqdm matplotlib scikit-learn scipy entmax pytest; do
    if grep -qi "^$extra==" "$SCRATCH/freeze.txt"; then fail "the core install pulled in $extra"; fi
done
echo "installed: $(tr '\n' ' ' <"$SCRATCH/freeze.txt")"

# from a folder outside the checkout, so that `import storch` is the installed wheel
mkdir "$SCRATCH/user" && cd "$SCRATCH/user"

step "import storch and the README's example"
"$VPY" - "$ROOT/README.md" <<'EOF'
import contextlib, io, re, sys
import storch
from importlib.metadata import version
assert "site-packages" in storch.__file__, storch.__file__
assert storch.__version__ == version("storch"), (storch.__version__, version("storch"))
print(f"storch {storch.__version__} from {storch.__file__}")
text = open(sys.argv[1]).read()
example = text[text.index("## Example"):]
code, expected = re.search(r"```python\n(.*?)```\s*```text\n(.*?)```", example, re.S).groups()
out = io.StringIO()
with contextlib.redirect_stdout(out):
    exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
print(out.getvalue(), end="")
assert out.getvalue() == expected, f"the README's example printed {out.getvalue()!r}, the README shows {expected!r}"
EOF

step "storch-bench list"
"$SCRATCH/venv/bin/storch-bench" list >"$SCRATCH/list.out"
head -3 "$SCRATCH/list.out" && echo "... ($(wc -l <"$SCRATCH/list.out") lines)"

step "storch-bench: 20 steps on the bundled digits (no extras: one line each for the progress bar and the plots)"
"$SCRATCH/venv/bin/storch-bench" --steps 20 --out runs >"$SCRATCH/bench.out" 2>&1 || { cat "$SCRATCH/bench.out"; fail "storch-bench"; }
cat "$SCRATCH/bench.out"
! grep -q "Traceback" "$SCRATCH/bench.out" || fail "storch-bench printed a traceback"
grep -q 'tqdm is not installed; pip install "storch\[bench\]"' "$SCRATCH/bench.out" || fail "no line about tqdm"
grep -q 'matplotlib is not installed; pip install "storch\[bench\]"' "$SCRATCH/bench.out" || fail "no line about matplotlib"
ls runs/*/summary.json runs/*/metrics.csv >/dev/null
"$VPY" -c "import sys; w = max(map(len, open(sys.argv[1]).read().splitlines())); print('widest line:', w); assert w <= 120" \
    "$SCRATCH/bench.out"

step "python -m storch.demo --help"
"$VPY" -m storch.demo --help >"$SCRATCH/demo-help.out"
head -4 "$SCRATCH/demo-help.out" && echo "... ($(wc -l <"$SCRATCH/demo-help.out") lines)"

step "GumbelSparseMax without the entmax extra: a one-line error"
"$VPY" - <<'EOF'
import torch
from torch.distributions import OneHotCategorical
import storch
try:
    storch.method.GumbelSparseMax("z")(OneHotCategorical(logits=torch.zeros(3)))
except ImportError as e:
    print(e)
    assert 'pip install "storch[entmax]"' in str(e) and "\n" not in str(e)
else:
    raise AssertionError("GumbelSparseMax sampled without entmax")
EOF

printf '\nwheel smoke test passed in %d s\n' $((SECONDS - start))
