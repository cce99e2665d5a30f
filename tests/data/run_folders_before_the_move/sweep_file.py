def get_sweep():
    return dict(
        method="grid",
        space={"learning_rate": ("categorical", [1e-3, 3e-3])},
        objective="dev/token_accuracy",
        direction="maximize",
        budget={"num_train_steps": 5, "eval_every_steps": 5, "checkpoint_every_steps": 5, "log_every_steps": 5, "warmup_steps": 2,
                "task.train_size": 300, "task.dev_size": 16, "task.test_size": 16, "model.d_model": 16, "model.num_heads": 2,
                "model.d_ff": 32, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1, "batch_size": 16,
                "curves_png": False, "visualize_examples": 0, "data_dir": "/tmp/fixture_data"},
    )
