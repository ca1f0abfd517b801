"""What the studio reads and shows, in plain Python (no Gradio): the recipe's data as the model will see it
(data_preview.py, data_render.py) and this machine's GPUs and host RAM while a run trains (hardware.py)."""
