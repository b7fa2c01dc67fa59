-- correct@budget on the embedded corpus (the King James Bible): verses and phrases of its training
-- split completed from their opening words, greedily. The first six are phrases a model meets
-- hundreds of times; the next are single famous verses; the last two ask for words that come a
-- verse or more later ("contains"), where the budget matters. Every answer is the corpus's own
-- text (tests/lua/tasks_spec.lua checks each against it).
return {
  name = "kjv",
  tasks = {
    {prompt = "\n  1 And the LORD spake unto Moses, ", answer = "saying,"},
    {prompt = "  2 Speak unto the children of ", answer = "Israel"},
    {prompt = " Verily, verily, I say unto ", answer = "you"},
    {prompt = "  1 And it came to ", answer = "pass"},
    {prompt = "  4 Thus saith the ", answer = "LORD"},
    {prompt = " for I am the ", answer = "LORD"},
    {prompt = "\nGenesis 1\n\n  1 In the beginning God created ", answer = "the heaven and the earth."},
    {prompt = "  3 And God said, Let there be light: ", answer = "and there was light."},
    {prompt = "\nPsalms 23\n\n  1 The LORD is my shepherd; ", answer = "I shall not want."},
    {prompt = "  3 Thou shalt have no other gods ", answer = "before me."},
    {prompt = "  16 For God so loved the world, that he gave his only begotten ", answer = "Son,"},
    {prompt = "  1 In the beginning was the Word, and the Word was with God, ", answer = "and the Word was God."},
    {prompt = "\nExodus 20\n\n  1 And God spake all these words, saying,\n", answer = "Thou shalt not",
     check = "contains"},
    {prompt = "\nMatthew 1\n\n  1 The book of the generation of Jesus Christ, ", answer = "Abraham",
     check = "contains"},
  },
}
