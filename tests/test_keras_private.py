"""Every private Keras name hyparflow relies on exists on the installed Keras (a new release breaks here, clearly)."""

import keras

from hyparflow import keras_private


def test_every_private_name_exists_on_the_installed_keras():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    owners = {"keras.Model": keras.Model, "compiled model": model,
              "functional input": model.inputs[0]}
    missing = [f"{owner}.{name}" for owner, names in keras_private.NAMES.items()
               for name in names if not hasattr(owners[owner], name)]
    assert not missing, (f"Keras {keras.__version__} lacks {missing}: update "
                         "hyparflow/keras_private.py for it.")


def test_overridden_tells_the_model_s_own_steps():
    class Own(keras.Model):
        def train_step(self, data):
            return {}

    x = keras.Input((3,))
    assert keras_private.overridden(keras.Model(x, keras.layers.Dense(2)(x))) == []
    assert keras_private.overridden(Own(x, keras.layers.Dense(2)(x))) == ["train_step"]
    assert keras_private.overridden(keras.Sequential([keras.layers.Dense(2)])) == []
