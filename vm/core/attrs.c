/*
** attrs.c — an op's attribute declarations (ops.h, dm_attr_decl): read once from the descriptor's
** .attrs at registration, then the defaults a call leaves out and the words of its enums.
*/
#define _GNU_SOURCE       /* memmem */
#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "core/ops.h"
#include "core/attrs.h"

const char *const dm_attr_kind_names[DM_ATTR_NKIND] = {
  [DM_ATTR_NUMBER] = "number", [DM_ATTR_INT] = "int", [DM_ATTR_BOOL] = "bool", [DM_ATTR_DIM] = "dim",
  [DM_ATTR_NEWDIM] = "newdim", [DM_ATTR_POS] = "pos", [DM_ATTR_DTYPE] = "dtype",
};

static dm_attr_decl decls[DM_MAXOPS][DM_MAXATTR + 1];
static int ndecls[DM_MAXOPS];

int dm_attr_word(const dm_attr_decl *d, const char *word, size_t len) {
  if (!d->words) return -1;
  const char *w = d->words, *end = d->words + d->words_len;
  for (int value = 0; w <= end; value++) {
    const char *bar = memchr(w, '|', (size_t)(end - w)), *stop = bar ? bar : end;
    if ((size_t)(stop - w) == len && strncmp(w, word, len) == 0) return value;
    w = stop + 1;
  }
  return -1;
}

/* the part of [p, stop) from after `mark` up to the next of the marks "=~@" (or stop) */
static const char *part(const char *p, const char *stop, char mark, int *len) {
  const char *at = memchr(p, mark, (size_t)(stop - p));
  if (!at) return NULL;
  const char *end = at + 1;
  while (end < stop && !strchr("=~@", *end)) end++;
  *len = (int)(end - at - 1);
  return at + 1;
}

static double number_of(const dm_op *op, const dm_attr_decl *d, const char *s, int len, const char *what) {
  char buf[64];
  if (len <= 0 || len >= (int)sizeof buf)
    dm_error("op %s: attribute %.*s: an empty or overlong %s", op->name, d->name_len, d->name, what);
  memcpy(buf, s, (size_t)len);
  buf[len] = '\0';
  if (d->words) {
    int w = dm_attr_word(d, buf, (size_t)len);
    if (w < 0) dm_error("op %s: attribute %.*s: its %s '%s' is not one of its words", op->name, d->name_len, d->name, what, buf);
    return w;
  }
  if (strcmp(buf, "true") == 0) return 1;
  if (strcmp(buf, "false") == 0) return 0;
  char *end;
  double v = strtod(buf, &end);
  if (*end || isspace((unsigned char)buf[0]) || isnan(v)) dm_error("op %s: attribute %.*s: its %s '%s' is not a number", op->name, d->name_len, d->name, what, buf);
  return v;
}

/* one item "name[:kind][=words][~default][@lua]" or "list=name[:kind]" in [p, stop) */
static dm_attr_decl parse_item(const dm_op *op, const char *p, const char *stop) {
  dm_attr_decl d;
  memset(&d, 0, sizeof d);
  if ((size_t)(stop - p) > 5 && strncmp(p, "list=", 5) == 0) { d.list = true; p += 5; }
  const char *name_end = p;
  while (name_end < stop && !strchr(":=~@", *name_end)) name_end++;
  d.name = p;
  d.name_len = (int)(name_end - p);
  for (const char *c = p; c < name_end; c++)
    if (!(*c == '_' || (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (c > p && *c >= '0' && *c <= '9')))
      dm_error("op %s: attrs '%s': '%.*s' is not a name", op->name, op->attrs, d.name_len, d.name);
  if (d.name_len == 0) dm_error("op %s: attrs '%s': an attribute without a name", op->name, op->attrs);
  const char *rest = name_end;
  if (rest < stop && *rest == ':') {
    const char *k = rest + 1, *k_end = k;
    while (k_end < stop && !strchr("=~@", *k_end)) k_end++;
    d.kind = -1;
    for (int i = 0; i < DM_ATTR_NKIND; i++)
      if ((size_t)(k_end - k) == strlen(dm_attr_kind_names[i]) && strncmp(k, dm_attr_kind_names[i], (size_t)(k_end - k)) == 0)
        d.kind = i;
    if (d.kind < 0) dm_error("op %s: attribute %.*s: unknown kind '%.*s'", op->name, d.name_len, d.name, (int)(k_end - k), k);
    rest = k_end;
  }
  unsigned seen = 0;                     /* after the name and kind: each of "=~@" at most once */
  if (rest < stop && !strchr("=~@", *rest))
    dm_error("op %s: attrs '%s': '%c' after %.*s", op->name, op->attrs, *rest, d.name_len, d.name);
  for (const char *m = rest; m < stop; m++) {
    const char *mark = strchr("=~@", *m);
    if (!mark) continue;
    unsigned bit = 1u << (mark - "=~@");
    if (seen & bit) dm_error("op %s: attribute %.*s: '%c' given twice", op->name, d.name_len, d.name, *m);
    seen |= bit;
  }
  int len = 0;
  const char *words = part(name_end, stop, '=', &len);
  if (words) {
    if (d.list) dm_error("op %s: the list attribute %.*s takes no words", op->name, d.name_len, d.name);
    if (d.kind != DM_ATTR_NUMBER) dm_error("op %s: the enum %.*s takes no kind", op->name, d.name_len, d.name);
    if (len == 0 || words[0] == '|' || words[len - 1] == '|' || memmem(words, (size_t)len, "||", 2))
      dm_error("op %s: the enum %.*s has an empty word", op->name, d.name_len, d.name);
    d.words = words;
    d.words_len = len;
  }
  const char *dflt = part(name_end, stop, '~', &len);
  if (dflt) { d.has_default = true; d.dflt = number_of(op, &d, dflt, len, "default"); }
  const char *fixed = part(name_end, stop, '@', &len);
  if (fixed) { d.fixed = true; d.fixed_value = number_of(op, &d, fixed, len, "Lua value"); }
  if (d.list && (dflt || fixed)) dm_error("op %s: the list attribute %.*s takes no default", op->name, d.name_len, d.name);
  return d;
}

void dm_attr_parse(const dm_op *op) {
  if (op->id < 0 || op->id >= DM_MAXOPS) dm_error("op %s: id %d past the attribute table", op->name, op->id);
  int n = 0;
  for (const char *p = op->attrs; p && *p;) {
    const char *comma = strchr(p, ','), *stop = comma ? comma : p + strlen(p);
    if (n == DM_MAXATTR + 1) dm_error("op %s: more than %d attributes", op->name, DM_MAXATTR);
    if (n > 0 && decls[op->id][n - 1].list) dm_error("op %s: attrs '%s': the list attribute comes last", op->name, op->attrs);
    decls[op->id][n] = parse_item(op, p, stop);
    for (int i = 0; i < n; i++)
      if (decls[op->id][i].name_len == decls[op->id][n].name_len &&
          strncmp(decls[op->id][i].name, decls[op->id][n].name, (size_t)decls[op->id][n].name_len) == 0)
        dm_error("op %s: attrs '%s': %.*s declared twice", op->name, op->attrs, decls[op->id][n].name_len,
                 decls[op->id][n].name);
    n++;
    if (comma && comma[1] == '\0') dm_error("op %s: attrs '%s' ends in a comma", op->name, op->attrs);
    if (n == DM_MAXATTR + 1 && !decls[op->id][n - 1].list) dm_error("op %s: more than %d attributes", op->name, DM_MAXATTR);
    p = comma ? comma + 1 : NULL;
  }
  ndecls[op->id] = n;
}

int dm_op_attr_decls(const dm_op *op, const dm_attr_decl **out) {
  *out = decls[op->id];
  return ndecls[op->id];
}

void dm_attr_fill(const dm_op *op, dm_attrs *a) {
  const dm_attr_decl *d = decls[op->id];
  for (int i = a->nv; i < ndecls[op->id] && !d[i].list; i++) {
    if (!d[i].has_default && d[i].words)
      dm_error("%s: the attribute %.*s is missing (one of %.*s)", op->name, d[i].name_len, d[i].name, d[i].words_len,
               d[i].words);
    if (!d[i].has_default) dm_error("%s: the attribute %.*s is missing", op->name, d[i].name_len, d[i].name);
    a->v[i] = d[i].dflt;
    a->nv = i + 1;
  }
}

double dm_attr(const dm_ctx *c, int i) {
  if (i < c->a.nv) return c->a.v[i];
  const dm_attr_decl *d = decls[c->op->id];
  if (i < ndecls[c->op->id]) dm_error("%s: the attribute %.*s is missing", c->op->name, d[i].name_len, d[i].name);
  dm_error("%s: attribute %d is missing", c->op->name, i + 1);
  return 0;
}
