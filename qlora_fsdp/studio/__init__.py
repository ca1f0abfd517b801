"""The local studio (`qlora-studio`): a web page on 127.0.0.1 that drives the same library as the command line.

The page's data lives in plain modules, tested without a browser: the recipe form (form.py), the resolved recipe
and its command (draft.py), the plan in a worker process (plan_worker.py) and its pictures (pictures.py), the run
(runs.py) and what it writes (live.py), chat with an adapter (chat.py). app.py only lays them out in Gradio.
"""
