"""Networks drafting at inference: the EAGLE head, Medusa heads, the distilled draft model, their
shared layer, and how trained ones are stored and found. Imports only core, models and errors;
training (losses, data, trainers) lives in :mod:`specdecode.train`, which runtime code never imports."""
