return {step = 1, files = {}, a = ("x"):rep(1.5e9), b = ("x"):rep(1.5e9)}
