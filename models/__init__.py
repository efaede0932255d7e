"""The torch layer, above settings/ only, one sub-package per concept: draft/ (the model), capture/, train/ and eval/
(the stages' rank entry points, `python -m models.<stage>`), export/, target/ (the target's loading, the tiny targets),
ranks/ (the rank harness), and common/, the torch-free pieces the layers above share (the jobs and job files, file
errors, atomic writes, the rank line protocol). Modules that do torch math import models.numerics."""
