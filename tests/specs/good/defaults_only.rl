

   
# blank lines and spaces before the header
algorithm defaults_only

  "Only a description: every slot takes its default."


