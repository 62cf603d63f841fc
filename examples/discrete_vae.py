"""The Storchastic manual's discrete VAE tutorial (§1.3), as a script.

Trains a VAE with 2 one-hot categorical latent variables of 10 values each, with a gradient
estimator of your choice, and every ``--eval-every`` steps prints the training ELBO, the gradient
variance and the (squared) gradient bias against the exact gradient from ``storch.method.Expect``.

    python examples/discrete_vae.py                          # score function, 10 samples, RLOO baseline
    python examples/discrete_vae.py --method gumbel
    python examples/discrete_vae.py --mnist ../shared/data   # the manual's 784-512-256-(2x10) model

Default data: scikit-learn's 8x8 digits, binarized (64 pixels; the network is 64-256-128-(2x10)).
The model and the generative story are in storch/demo/vae.py; ``python -m storch.demo --part vae``
runs all four estimators and prints a summary table.
"""

import argparse

import torch

import storch
from storch.datasets import load_digits_binarized, minibatches
from storch.demo.vae import DiscreteVAE, generative_story, load_mnist_data

METHODS = {
    "score": lambda: storch.method.ScoreFunction("z", n_samples=1, baseline_factory=None),
    "score-rloo": lambda: storch.method.ScoreFunction("z", n_samples=10, baseline_factory="batch_average"),
    "gumbel": lambda: storch.method.GumbelSoftmax("z", n_samples=1),
    "expect": lambda: storch.method.Expect("z"),
}


def centred_grad(z):
    # The gradient w.r.t. the (normalised) probs is defined up to a constant per latent variable;
    # centre it over the 10 values so that different estimators can be compared (storch/demo/vae.py).
    g = z.param_grads["probs"]
    return g - g.mean(-1, keepdim=True)


def evaluate(method, model, data, optimizer, n_samples=100):
    # Compute expected gradient
    optimizer.zero_grad()
    z = generative_story(storch.method.Expect("z"), model, data)
    storch.backward()
    expected_gradient = centred_grad(z)

    # Collect gradient samples
    gradients = []
    for i in range(n_samples):
        optimizer.zero_grad()
        z = generative_story(method, model, data)
        elbo = storch.backward()
        gradients.append(centred_grad(z))

    gradients = storch.gather_samples(gradients, "gradients")
    mean_gradient = storch.reduce_plates(gradients, "gradients")
    bias_gradient = storch.reduce_plates((mean_gradient - expected_gradient) ** 2).sum()
    print(
        "Training ELBO " + str(elbo.item())
        + " Gradient variance " + str(storch.variance(gradients, "gradients").sum().item())
        + " Gradient bias " + str(bias_gradient.item())
    )


def train(method, model, images, epochs, batch_size, lr, eval_every):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    step = 0
    for epoch in range(epochs):
        print("Epoch:" + str(epoch + 1))
        for data in minibatches(images, batch_size):
            optimizer.zero_grad()
            generative_story(method, model, data)
            storch.backward()
            optimizer.step()
            if step % eval_every == 0:
                evaluate(method, model, data, optimizer)
            step += 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=sorted(METHODS), default="score-rloo")
    p.add_argument("--mnist", metavar="DIR", help="binarized MNIST directory (never downloads)")
    p.add_argument("--epochs", type=int, default=None, help="default: 10 on digits, 5 on MNIST")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    if args.mnist:
        name, images = load_mnist_data(args.mnist)
        model = DiscreteVAE(784, (512, 256), 2, 10)  # the manual's model
        settings = {"epochs": args.epochs or 5, "batch_size": 64, "lr": 1e-3, "eval_every": 300}
    else:
        name, images = "binarized digits", load_digits_binarized()[0]
        model = DiscreteVAE(64, (256, 128), 2, 10)
        settings = {"epochs": args.epochs or 10, "batch_size": 32, "lr": 3e-3, "eval_every": 57}
    print(f"Training on {name} with {args.method}")
    train(METHODS[args.method](), model, images, **settings)
