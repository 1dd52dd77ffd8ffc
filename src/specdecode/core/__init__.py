"""Pure tensor math: logit processing, exact verification, tree masks. No model imports."""
