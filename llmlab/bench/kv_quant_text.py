"""A fixed English text for `llmlab bench kv-quant`: 2,255 tokens of the embedded model's
tokenizer (about 1,900 words), written for llmlab so that it can ship with it: prose of
the kind a small instruct model has seen (narrative, description, a little history).

Paragraphs are wrapped for reading; `text()` joins each paragraph's lines back into one.
"""

TEXT = """\
The Keeper of Gull Point

The lighthouse at Gull Point was built in 1871, on a shelf of black rock that the sea had been
trying to take back ever since. For most of its first century it was kept by families who lived
in the narrow stone house beside the tower, raised their children on the wind, and measured
their days in the slow turning of the lamp. The last of those keepers was a woman named Agnes
Morrow, who came to the point in the spring of 1958 with her husband Thomas and stayed on alone
for eleven years after he died.

Agnes kept a logbook, as every keeper was required to do, but hers is unusual. Alongside the
weather, the hours the lamp was lit and the ships that passed, she wrote down whatever she
happened to be thinking about. On the fourth of March, 1962, after a note that the wind had
backed to the northeast and the glass was falling, she wrote: "A keeper's work is mostly
waiting. You wait for the dark, and then you wait for the light, and in between you make sure
that nothing you have done in the day will fail you in the night." The entry for the next
morning records that a fishing boat called the Margaret Ann had come in under the lee of the
point at two in the morning, its engine dead, and that Agnes had kept the lamp burning and the
fog signal sounding until the boat was safe in the harbor at dawn.

How a lighthouse works

A lighthouse does two jobs. At night it tells a ship where the land is, and by the pattern of
its light it tells the ship which land it is. Every light on a coast has its own character: one
might show a single white flash every ten seconds, another two red flashes every fifteen, a
third a steady light that is briefly eclipsed. A navigator who sees a light, times it with a
watch, and looks it up in the list of lights knows at once which headland is in front of him,
and from the bearing of two such lights he can fix his position on the chart.

The light itself was, for a long time, a surprisingly small flame. What made it visible twenty
miles out to sea was the lens. In the early nineteenth century a French physicist, Augustin
Fresnel, worked out that a large lens could be built from concentric rings of glass, each ring a
slice of a much thicker lens, so that the whole thing bent light like a solid block of glass but
weighed a fraction as much. Prisms above and below the central rings caught the light that would
otherwise have escaped upward or downward and turned it out toward the horizon. A first-order
Fresnel lens stood taller than a man and was set on a turntable that floated in a bath of
mercury, so that a clockwork driven by a falling weight could turn several tons of glass with
almost no friction. The keeper's duty, several times a night, was to climb the stairs and wind
the weight back up.

Before electricity, the flame burned whale oil, then colza oil pressed from rapeseed, then lard
oil, and finally kerosene. Each change was made for the same reason: the cheaper fuel gave as
much light, or nearly, for less money. The wick had to be trimmed so that the flame burned clean
and bright without smoke, which would blacken the glass. That is where the old name for keepers,
wickies, came from. A keeper who let the glass grow dim was likely to hear about it from the
inspector, who arrived without warning a few times a year, ran a white glove along the brass,
and wrote down what he found.

Fog was the other enemy. On a clear night a good light could be seen from the deck of a ship
long before the ship was in danger, but in fog even the brightest lamp vanished within a few
hundred yards. So the stations were given voices as well as eyes: bells, then steam whistles,
then compressed-air horns whose low moan could carry for miles across the water. Each fog
signal, like each light, had its own pattern of blasts and silences, and keepers learned to
sleep through the noise, or at least to rest in the spaces between the blasts.

A day at the point

The keeper's day began at sunrise, when the lamp was put out and the curtains drawn around the
lens to keep the sun from cracking it or, worse, focusing its heat onto something that might
burn. Then came the cleaning. The lens was wiped with a soft cloth and polished with rouge. The
brass was shined, the windows of the lantern room washed inside and out, the lamp refilled and
its wicks trimmed. After that there was the station itself to look after: the paint that salt
air peeled from every surface, the gutters that fed rain into the cistern, the garden that had
to be coaxed out of thin soil, the boat that had to be kept ready in case anyone needed
rescuing, or in case the keeper needed to row to town.

Agnes grew potatoes, cabbages and a stubborn row of beans behind a low wall that her husband had
built to keep the spray off. She kept chickens, too, and wrote in the log when a gull took one
of them. She read a great deal. Books came out on the supply boat every two weeks from the
public library in the town, and she returned them with notes tucked inside, which the librarian,
a patient man named Harold Finch, kept in a folder and later gave to the local historical
society. One of the notes, left in a book about the stars, says: "I have watched these same
constellations turn over the tower for four years now and I still cannot find the one the book
calls the Lynx. Perhaps it is shy. Perhaps it is hiding behind the light."

In the evening, half an hour before sunset, the curtains came down and the lamp was lit. For the
rest of the night someone had to be awake. When Thomas was alive the two of them took turns,
four hours on and four hours off. Afterward, Agnes slept in short pieces, waking every two hours
to climb the tower, check the flame and wind the clockwork. She said in an interview, many years
later, that she never once overslept, because the tower had a sound it made when all was well, a
faint ticking of the clockwork and a whisper of wind through the vents, and that if the sound
changed she woke at once, wherever she was.

Storms

The worst storm in the log came in October of 1966. The barometer dropped faster than Agnes had
ever seen it drop, and by evening the wind was strong enough to lean on. Waves broke over the
rock and ran up the path to the house. Spray reached the lantern room, one hundred and ten feet
above the sea, and crusted the glass with salt, so that every hour she had to go out onto the
narrow gallery, tied to the railing with a rope around her waist, and wash the windows with
fresh water from a bucket. Around midnight a pane on the seaward side cracked. She covered it
with a board and a blanket and kept the light going behind it.

Toward morning the wind dropped as suddenly as it had risen. When the sun came up the rock was
covered with seaweed and broken wood, and the boat house had lost its door. Two miles offshore a
cargo ship was riding at anchor, waiting for the sea to go down before it tried the channel. Its
captain later wrote to the lighthouse service to say that he had seen the light all night,
flashing every ten seconds as it always did, and that without it he would have had no idea how
close he had drifted to the point. Agnes pasted a copy of the letter into the log, and beneath
it wrote only: "Replaced pane. Repainted boat house door. Beans finished."

The end of keeping

By the late 1960s the lighthouse service had begun to replace keepers with machines. An electric
lamp could be switched on and off by a photocell that sensed the dark. A timer could run the fog
signal, and a radio could report a fault to a station on shore. A single technician, driving
from one light to the next, could do the work that had once needed dozens of families living out
on the rocks. It was cheaper, and in most ways it was just as safe. The ships themselves were
changing, too: radar and then satellite navigation meant that a captain no longer needed to see
a light to know where he was.

Gull Point was automated in the summer of 1969. Agnes was offered a position at a shore station
and turned it down. She moved to a small house in the town, a short walk from the library, and
lived there for another twenty-six years. From her kitchen window she could see the tower on its
rock, and every evening, she said, she watched for the moment the light came on by itself,
without her. The first few times, it felt like watching someone else raise her child. Later, she
said, it felt more like watching a friend keep a promise.

What the logbooks tell us

The logbooks of Gull Point, now kept in the archive of the historical society, run to forty-one
volumes. Most of what they contain is exactly what the lighthouse service asked for: wind
direction and strength, the state of the sea, the hours of lighting, the amount of oil burned,
the ships that passed and the signals they made. Historians have used them to study the weather
of the coast over a hundred years, to count the shipping that used the channel, and to follow
the slow changes in the way the service was run.

But readers keep coming back to the margins. In them the keepers, and Agnes more than any of the
others, wrote down the things that do not fit in a column: the first swallow of the spring, the
names of children born in the house, a recipe for fish soup, a quarrel with the inspector about
the color of paint, a description of the northern lights so vivid that it reads like a letter.
Read together, the books are a record of a particular kind of attention, the kind that comes
from doing one small job very carefully for a very long time, in a place where the job matters.

The lamp still turns at Gull Point, and ships still pass it, though most of them no longer look.
The stone house is empty, the garden wall has fallen down, and the gulls have the rock to
themselves. On clear nights, people from the town sometimes walk out to the end of the harbor
wall to watch the flash come round, once every ten seconds, the same as it has done since 1871.
"""


def text() -> str:
    """TEXT with each paragraph on one line, as it was written."""
    return "\n\n".join(" ".join(paragraph.split("\n")) for paragraph in TEXT.strip().split("\n\n"))
