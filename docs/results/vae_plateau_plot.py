"""The figure and the tables of the Bernoulli VAE's plateau from the CSV files of `vae_plateau.sh`.

usage: python docs/results/vae_plateau_plot.py RUN_DIR OUT.png

Prints a Markdown table per setting (``paper_*.csv``: Adam 1e-4, batch 100; ``fast_*.csv``: Adam
1e-3, batch 50) and draws four panels per setting against the steps: test −ELBO, KL(q ‖ p), the
encoder's dependence on the image (``x_dep``) and the norm of the reconstruction's part of the
encoder's gradient (the runs in `DRAWN`).
"""
import csv
import sys
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

PANELS = [("test_nelbo", "test −ELBO", "linear"), ("kl", "KL(q(z|x) ‖ p(z)), nats", "log"),
          ("x_dep", "encoder's dependence on x (std of logits)", "log"),
          ("g_enc_rec", "‖encoder gradient‖, reconstruction part", "log")]
SETTINGS = [("paper", "Adam 1e-4, batch 100 (GSB paper)"), ("fast", "Adam 1e-3, batch 50 (storch-bench)")]
COLUMNS = ["step", "test_nelbo", "recon", "kl", "x_dep", "sat05", "entropy", "active", "dead1", "dead2",
           "g_enc_rec", "g_enc_kl", "g_enc_kl_exact", "g_dec"]


#: the runs drawn, one colour each in both settings (the tables list every run)
DRAWN = ["le", "rebar", "disarm", "le_analytic_kl", "le_warmup100", "rebar10", "disarm20", "auto4", "auto40"]


def color(name: str) -> str:
    return f"C{DRAWN.index(name)}"


def load(run_dir: Path, prefix: str) -> dict[str, list[dict]]:
    runs = {}
    for f in sorted(run_dir.glob(f"{prefix}_*.csv")):
        with open(f) as fh:
            runs[f.stem[len(prefix) + 1:]] = list(csv.DictReader(fh))
    return runs


def fmt(v: str) -> str:
    if v == "":
        return ""
    x = float(v)
    if x == int(x) and abs(x) < 1e5:
        return str(int(x))
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.1f}"


def table(runs: dict[str, list[dict]], every: int) -> str:
    lines = ["| run | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for name, rows in runs.items():
        for r in rows:
            if int(r["step"]) % every == 0 or r is rows[-1]:
                lines.append(f"| {name} | " + " | ".join(fmt(r[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main():
    run_dir, out = Path(sys.argv[1]), sys.argv[2]
    fig, axes = plt.subplots(len(SETTINGS), len(PANELS), figsize=(4.2 * len(PANELS), 3.4 * len(SETTINGS)))
    for row, (prefix, title) in zip(axes, SETTINGS):
        runs = load(run_dir, prefix)
        print(f"\n{title}\n\n{table(runs, 300 if prefix == 'paper' else 100)}")
        for ax, (col, label, scale) in zip(row, PANELS):
            for name, rows in runs.items():
                if name not in DRAWN:
                    continue
                pts = [(int(r["step"]), float(r[col])) for r in rows if r[col] and float(r[col]) > 0]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color(name), label=name, marker=".")
            ax.set_yscale(scale)
            ax.set_xlabel("step")
            ax.set_title(f"{label}\n{title}", fontsize=8)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


if __name__ == "__main__":
    main()
