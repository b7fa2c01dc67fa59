return {step = 3, rng = {1, 2}, data = {position = 7}, files = {}}
