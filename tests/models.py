"""The small models and losses the Python tests compile and train: each defined once here."""

import rlx


class LinearNet(rlx.nn.Module):
    """One linear layer (``fc``): ``d_in`` features to ``d_out`` outputs."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = rlx.nn.Linear(d_in, d_out)

    def __call__(self, x):
        return self.fc(x)


class MLP(rlx.nn.Module):
    """Two linear layers (``fc1``, ``fc2``) with a relu between them."""

    def __init__(self, d_in, d_h, d_out):
        super().__init__()
        self.fc1 = rlx.nn.Linear(d_in, d_h)
        self.fc2 = rlx.nn.Linear(d_h, d_out)

    def __call__(self, x):
        return self.fc2(rlx.relu(self.fc1(x)))


def ce_loss(m, x, y):
    """Cross-entropy of the model's logits against integer labels."""
    return rlx.cross_entropy(m(x), y)


def mse_loss(m, x, y):
    """Mean squared error of the model's output against targets."""
    return rlx.mse_loss(m(x), y)
