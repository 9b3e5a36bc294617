"""Every private Keras name hyparflow relies on exists on
the installed Keras (a new release breaks here, clearly)."""

import importlib
import pathlib
import re

import keras

import hyparflow
from hyparflow.keras import keras_private


def _built(layer):
    layer.build((None, 3))
    return layer


def test_every_private_name_exists_on_the_installed_keras():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x = keras.Input((3,))
    functional = keras.Model(x, keras.layers.Dense(2)(x))
    masked = keras.layers.Embedding(4, 2, mask_zero=True)(keras.Input((3,), dtype="int32"))
    owners = {"keras.Model": keras.Model, "masked output": masked, "compiled model": model,
              "layer": keras.layers.Dropout(0.5),
              "BatchNormalization": _built(keras.layers.BatchNormalization()),
              "functional model": functional,
              "functional input": model.inputs[0], "optimizer": keras.optimizers.SGD(),
              "keras.callbacks.ModelCheckpoint": keras.callbacks.ModelCheckpoint,
              "keras.callbacks.BackupAndRestore": keras.callbacks.BackupAndRestore,
              "BackupAndRestore": keras.callbacks.BackupAndRestore("/tmp/backup"),
              "keras.Sequential": keras.Sequential([keras.layers.Dense(2)])}
    assert sorted(owners) == sorted(keras_private.NAMES)
    missing = [f"{owner}.{name}" for owner, names in keras_private.NAMES.items()
               for name in names if not hasattr(owners[owner], name)]
    for module in keras_private.MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    assert not missing, (f"Keras {keras.__version__} lacks {missing}: update "
                         "hyparflow/keras/keras_private.py for it.")


def test_private_keras_is_used_only_through_keras_private():
    root = pathlib.Path(hyparflow.__file__).parent
    users = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if p.name != "keras_private.py" and "keras.src" in p.read_text()]
    assert not users, f"{users} import keras.src: go through hyparflow/keras/keras_private.py"


def test_private_keras_attributes_are_read_only_through_keras_private():
    # a private attribute read by name (getattr(model, "_functional", None)) escapes the
    # check above and the canary (hyparflow's own marks: "_hyparflow..."; dunders: Python's)
    root = pathlib.Path(hyparflow.__file__).parent
    by_name = re.compile(r"(getattr|hasattr|setattr)\([^,()]+,\s*[\"'](_(?!_|hyparflow)\w*)")
    found = [f"{p.relative_to(root)}: {m.group(0)}" for p in sorted(root.rglob("*.py"))
             if p.name != "keras_private.py" for m in by_name.finditer(p.read_text())]
    assert not found, f"{found}: read private Keras names through hyparflow/keras/keras_private.py"


def test_overridden_tells_the_model_s_own_steps():
    class Own(keras.Model):
        def train_step(self, data):
            return {}

    x = keras.Input((3,))
    assert keras_private.overridden(keras.Model(x, keras.layers.Dense(2)(x))) == []
    assert keras_private.overridden(Own(x, keras.layers.Dense(2)(x))) == ["train_step"]
    assert keras_private.overridden(keras.Sequential([keras.layers.Dense(2)])) == []
