"""The inverse-dynamics model (IDM) that scores action following: the model over a VQ's frozen code vectors, its
save and the token folder it was trained on (model.py), the frame pairs it reads and the scores it gives
(scores.py). Below eval, which scores with it (mcar.eval.action_following loads it), and train, which trains it
(`mcar idm`)."""
