"""Demonstrations: an environment's scripted solutions played through the real agent loop (``play``), the tiny
model's pre-training text drawn from them (``pretraining``), and which of these an environment's hooks enable
(``features``). The warm start (``ctxrl.train.warm_start``) and the tiny model's build (``ctxrl.train.tiny``)
train on them.
"""
