"""One file a model family, each defining FAMILY (engine/models/family.py: ModelFamily); the
registry imports every module here by name, so a new family is a new file and nothing else."""
