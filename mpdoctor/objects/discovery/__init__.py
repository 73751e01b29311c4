"""Discovery: which of the user's objects are patients (models, optimizers, scalers, trainers, ...)."""
