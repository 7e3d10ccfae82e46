"""Diagnostics, for the user and for the failing step, never run by a clean step: gradient reports and the loss scale's
plot (`grads`), where an overflow starts, found on copies of the model (`overflow`), what a callback does when the loss
scale cannot go lower (`collapse`, registered with the callbacks), and `learn.precision_check()` with its advice
(`precision_check`). They sit above the callbacks: they read a fit's setup; the callbacks never import them."""
from .grads import (plot_loss_scale, plot_precision_health, gradient_report, plot_gradient_range, GradientReport,
                    state_bytes,
                    scaling_callback, scale_health)
from .overflow import Precision, diagnose_collapse
from . import collapse  # noqa: F401 (registers the diagnosis of a collapsing loss scale)
from .precision_check import precision_check, plot_precision_check

__all__ = ['plot_loss_scale', 'plot_precision_health', 'gradient_report', 'plot_gradient_range', 'GradientReport',
           'state_bytes', 'Precision',
           'diagnose_collapse', 'precision_check', 'plot_precision_check']
